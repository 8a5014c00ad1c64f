"""`/v1/responses` on a real server (demo model, loopback) through the official `openai` client: create, retrieve,
continue with `previous_response_id` (served from the kept conversation and its retained KV), streamed events, delete,
`store: false`, tenant isolation, the store's bounds, persistence next to the disk tier, function calls and
`text.format` through the chat endpoint's parsers and grammars, and 400s naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseItemList
from prometheus_client.parser import text_string_to_metric_families

from sage_infer.config.responses import ResponsesConfig
from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig, TierConfig
from sage_infer.server.api import build_app
from sage_infer.server.launch import build_server, http_server
from tests.server_fixture import serving

FIRST = "Speak, friend, and enter the hall of the king, for the night is cold."


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    return tmp_path_factory.mktemp("responses-disk")


@pytest.fixture(scope="module")
def server(disk):
    """The demo model with a 24-block device pool (other traffic evicts a conversation unless it is retained), a disk
    tier (stored responses persist next to it), and a store of at most 6 responses."""
    config = ServeConfig(model=ModelConfig(dtype="fp32"), kv_pool=KVPoolConfig(num_blocks=24),
                         scheduler=SchedulerConfig(max_num_seqs=4), port=0,
                         tiers=TierConfig(host_bytes=0, disk_path=str(disk / "kv"), disk_bytes=1 << 24),
                         responses=ResponsesConfig(max_stored=6, ttl_s=600))
    http, backend, name = build_server(config, drain_seconds=2)
    with serving(http) as url:
        yield url, name, http.config.app


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="key-a", max_retries=0)


def create(client, server, **kwargs) -> Response:
    kwargs.setdefault("max_output_tokens", 12)
    return client.responses.create(model=server[1], temperature=0, **kwargs)


def flood(client, server, n: int = 6) -> None:
    """Other traffic: distinct prompts of 5 blocks each through the 24-block pool."""
    for i in range(n):
        client.completions.create(model=server[1], prompt=[7 + (i * 53 + 3 * j) % 900 for j in range(80)],
                                  max_tokens=1, temperature=0)


def scrape(url: str) -> dict[str, float]:
    found = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            found[sample.name] = sample.value
    return found


def hits(url: str) -> tuple[float, float]:
    """Prompt tokens served so far from the device's prefix cache, and loaded from a lower tier (/metrics)."""
    found = scrape(url)
    return found["sage:prefix_cache_hits_total"], found["sage:prefix_cache_lower_hits_total"]


def test_create_retrieve_and_continue_hits_the_first_turns_kv_after_other_traffic(client, server):
    play = "Answer as a player would."
    first = create(client, server, input=FIRST, instructions=play, metadata={"scene": "1"})
    assert first.status in ("completed", "incomplete") and first.output_text and first.metadata == {"scene": "1"}
    assert first.id.startswith("resp_") and first.object == "response" and first.output[0].type == "message"
    Response.model_validate(first.model_dump())  # the shape OpenAI's types define, strictly
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    flood(client, server)  # would evict the first turn's blocks, were they not retained
    # instructions are not carried to the next turn (as OpenAI does): the same ones are given again
    before = hits(server[0])
    second = create(client, server, input="And what of the queen?", previous_response_id=first.id, instructions=play)
    after = hits(server[0])
    assert second.previous_response_id == first.id
    context = first.usage.input_tokens + first.usage.output_tokens - 1  # the last token's KV is never computed
    assert second.usage.input_tokens > context
    assert second.usage.input_tokens_details.cached_tokens >= context // 16 * 16 > 0
    # from the device, where retention kept them, not loaded back from the disk tier
    assert after[0] - before[0] >= context // 16 * 16 and after[1] == before[1]
    retained = scrape(server[0])
    assert retained["sage:kv_retained_conversations"] >= 2 and retained["sage:kv_retained_blocks"] >= context // 16


def test_the_next_turn_is_the_previous_context_plus_its_output_plus_the_new_input(client, server):
    first = create(client, server, input=FIRST)
    flood(client, server)
    before = hits(server[0])
    second = create(client, server, input="And what of the queen?", previous_response_id=first.id)
    context = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens >= context // 16 * 16 > 0
    assert hits(server[0])[0] - before[0] >= context // 16 * 16  # device hits (retained)
    by_hand = client.responses.create(model=server[1], temperature=0, max_output_tokens=12, store=False, input=[
        {"role": "user", "content": FIRST}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": [{"type": "input_text", "text": "And what of the queen?"}]}])
    assert by_hand.usage.input_tokens == second.usage.input_tokens
    assert by_hand.output_text == second.output_text


def test_stream_events_parse_in_order_and_the_streamed_response_is_stored(client, server):
    events = list(client.responses.create(model=server[1], input=FIRST, max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    done = "response.incomplete" if kinds[-1] == "response.incomplete" else "response.completed"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          done]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text and 1 <= final.usage.output_tokens <= 8
    assert (final.status == "incomplete") == (final.usage.output_tokens == 8)  # cut by max_output_tokens
    assert client.responses.retrieve(final.id).output_text == text


def test_input_items_list_the_conversation_a_page_at_a_time_as_openai_does(client, server):
    first = create(client, server, input=FIRST, instructions="Answer as a player would.")
    second = create(client, server, input=[{"role": "user", "content": [{"type": "input_text", "text": "And?"}]}],
                    previous_response_id=first.id)
    listed = client.responses.input_items.list(second.id, order="asc", limit=100)
    ResponseItemList.model_validate(listed.model_dump())  # the shape OpenAI's types define, strictly
    items = listed.data
    assert [i.id for i in items[1:-1]] == [i.id for i in first.output]  # the previous output, as it was
    assert (items[0].role, items[0].content[0].text) == ("user", FIRST)  # instructions are no item
    assert (items[-1].role, items[-1].content[0].text, items[-1].type) == ("user", "And?", "message")
    ids = [i.id for i in items]
    assert len(set(ids)) == len(ids) and not listed.has_more
    newest_first = client.responses.input_items.list(second.id)  # order desc by default
    assert [i.id for i in newest_first.data] == ids[::-1]
    assert [i.id for i in client.responses.input_items.list(second.id, limit=1)] == ids[::-1]  # page by `after`
    one = client.responses.input_items.list(second.id, limit=1, order="asc", after=ids[0])
    assert [i.id for i in one.data] == [ids[1]] and one.has_more == (len(ids) > 2)
    before = client.responses.input_items.list(second.id, limit=2, order="asc", extra_query={"before": ids[-1]})
    assert [i.id for i in before.data] == ids[-3:-1]
    assert [i.id for i in client.responses.input_items.list(first.id, order="asc")] == ids[:1]
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "A player."}]}
    kept_by_client = create(client, server, max_output_tokens=2, input=[  # a reasoning item leads to its answer
        {"role": "user", "content": FIRST}, thought, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And?"}])
    listed = client.responses.input_items.list(kept_by_client.id, order="asc").data
    assert [i.type for i in listed] == ["message", "reasoning", "message", "message"]
    assert listed[1].content[0].text == "A player." and listed[2].role == "assistant"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.input_items.list("resp_" + "0" * 32)
    assert err.value.body["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):  # another tenant's
        openai.OpenAI(base_url=f"{server[0]}/v1", api_key="key-b", max_retries=0).responses.input_items.list(first.id)
    for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after"),
                         ({"include": ["reasoning.encrypted_content"]}, "include")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.input_items.list(second.id, **query)
        assert err.value.body["param"] == param


def test_store_false_keeps_nothing_and_delete_forgets(client, server):
    unstored = create(client, server, input=FIRST, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as err:
        create(client, server, input="Go on.", previous_response_id=unstored.id)
    assert err.value.body["param"] == "previous_response_id"
    stored = create(client, server, input=FIRST)
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(stored.id)


def test_another_tenant_can_neither_read_continue_nor_delete(client, server):
    mine = create(client, server, input=FIRST, extra_body={"cache_salt": "tenant-a"})
    for other in (openai.OpenAI(base_url=f"{server[0]}/v1", api_key="key-b", max_retries=0),  # another key
                  client):  # the same key without the salt
        with pytest.raises(openai.NotFoundError) as err:
            other.responses.retrieve(mine.id)
        assert err.value.body["type"] == "not_found_error"
        with pytest.raises(openai.NotFoundError):
            create(other, server, input="Go on.", previous_response_id=mine.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(mine.id)
    salted = {"X-Cache-Salt": "tenant-a"}
    assert client.responses.retrieve(mine.id, extra_headers=salted).id == mine.id
    follow = create(client, server, input="Go on.", previous_response_id=mine.id, extra_body={"cache_salt": "tenant-a"})
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_the_store_keeps_at_most_max_stored_and_persists_next_to_the_disk_tier(client, server, disk):
    ids = [create(client, server, input=f"Line {i}: {FIRST}", max_output_tokens=2).id for i in range(8)]
    for old in ids[:2]:  # max_stored is 6: the oldest went, with their KV retention
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(old)
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    store = server[2].state.responses.store
    assert len(store) == 6 and sorted(p.stem for p in (disk / "kv" / "responses").glob("*.json")) == \
        sorted(store._items)
    # a restarted server over the same directory serves them (the engine here is the running one; the store is new)
    app = build_app(server[2].state.backend, responses=ResponsesConfig(max_stored=6, ttl_s=600),
                    responses_dir=str(disk / "kv" / "responses"))
    with serving(http_server(app, "127.0.0.1", 0)) as url:
        again = openai.OpenAI(base_url=f"{url}/v1", api_key="key-a", max_retries=0)
        assert again.responses.retrieve(ids[-1]).output_text == client.responses.retrieve(ids[-1]).output_text
        follow = create(again, server, input="Go on.", previous_response_id=ids[-1])
        assert follow.usage.input_tokens_details.cached_tokens > 0


def test_an_expired_response_is_gone(client, server):
    store = server[2].state.responses.store
    response = create(client, server, input=FIRST)
    store._items[response.id][0].expires_at = 0.0  # its TTL passed
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


WEATHER = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Rome", "Paris"]}}, "required": ["city"],
                           "additionalProperties": False}}]


def test_a_required_tool_choice_is_a_function_call_item_and_its_output_continues_the_conversation(client, server):
    called = create(client, server, input="The weather in Rome?", tools=WEATHER, tool_choice="required",
                    parallel_tool_calls=False, max_output_tokens=40)  # one call: the grammar ends after it
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and called.status == "completed"
    assert json.loads(calls[0].arguments)["city"] in ("Rome", "Paris")
    assert called.tools[0].name == "get_weather" and called.tool_choice == "required"
    follow = create(client, server, previous_response_id=called.id, tools=WEATHER, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.output[0].type == "message" and follow.usage.input_tokens_details.cached_tokens > 0
    given = list(client.responses.input_items.list(follow.id, order="asc"))
    assert [i.type for i in given] == ["message", *(i.type for i in called.output), "function_call_output"]
    assert given[-1].call_id == calls[0].call_id and given[-1].output == "sunny"
    events = list(client.responses.create(model=server[1], input="And in Paris?", tools=WEATHER, temperature=0,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=40, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["city"] in ("Rome", "Paris")
    assert events[-1].response.output[done[0].output_index].arguments == done[0].arguments
    kinds = [e.type for e in events]  # the call streams as it is written, before the answer's text is done
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == done[0].arguments
    assert kinds.index("response.function_call_arguments.delta") < kinds.index("response.output_text.done")
    streamed = events[-1].response
    follow = create(client, server, previous_response_id=streamed.id, tools=WEATHER, input=[
        {"type": "function_call_output", "call_id": streamed.output[done[0].output_index].call_id, "output": "rain"}])
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_text_format_json_schema_constrains_the_output(client, server):
    schema = {"type": "object", "properties": {"mood": {"enum": ["merry", "sad"]}}, "required": ["mood"],
              "additionalProperties": False}
    answer = create(client, server, input="How art thou?", max_output_tokens=30,
                    text={"format": {"type": "json_schema", "name": "mood", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(answer.output_text), schema)
    assert answer.text.format.type == "json_schema"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
     "text.format.schema"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": WEATHER, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools[0].parameters"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": []}]}, "input[1]"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}, {"role": "assistant",
                                                                                  "content": "hi"}]},
     "input[0].encrypted_content"),
])
def test_bad_input_is_an_openai_error_naming_the_field(server, body, param):
    reply = httpx.post(f"{server[0]}/v1/responses", json={"model": server[1], **body})
    assert reply.status_code == (404 if param == "previous_response_id" else 400)
    assert reply.json()["error"]["param"] == param


def test_the_agent_bench_speaks_chat_and_responses_and_both_send_the_same_conversations(server, sage):
    """`sage llm bench --workload agent --api chat|responses`: the same sessions as text, the whole history every
    step (chat) or only the new tool output after previous_response_id (responses); the server renders the same
    prompts either way, and a continued session's history is a prefix hit."""
    runs = {}
    for api in ("chat", "responses"):
        result = sage("llm", "bench", "--url", server[0], "--workload", "agent", "--api", api, "--num-requests", "6",
                      "--turns", "3", "--prefix-len", "24", "--context-len", "12", "--input-len", "6",
                      "--output-len", "4", "--concurrency", "2", "--seed", "3", "--json", "-")
        assert result.code == 0, result.err
        runs[api] = json.loads(result.out)
        assert runs[api]["summary"]["ok"] == 6 and runs[api]["config"]["api"] == api
    prompts = {api: {(r["conversation"], r["turn"]): r["prompt_tokens"] for r in runs[api]["requests"]}
               for api in runs}
    assert prompts["chat"] == prompts["responses"]
    later = [r for r in runs["responses"]["requests"] if r["turn"] > 0]
    assert all(r["cached_tokens"] >= 16 for r in later)
    refused = sage("llm", "bench", "--url", server[0], "--workload", "random", "--api", "responses")
    assert refused.code == 2 and "--api does not apply to --workload random" in refused.err


def test_the_agent_bench_calls_tools_and_answers_each_call_with_its_output(server, sage):
    """`--tool-calls`: every step offers tools with tool_choice required (so every answer is a call, constrained),
    and the next step answers it (a tool message / a function_call_output item); the report counts valid calls."""
    for api in ("chat", "responses"):
        result = sage("llm", "bench", "--url", server[0], "--workload", "agent", "--api", api, "--tool-calls",
                      "--num-requests", "4", "--turns", "2", "--prefix-len", "24", "--context-len", "12",
                      "--input-len", "6", "--output-len", "48", "--concurrency", "2", "--seed", "4", "--json", "-")
        assert result.code == 0, result.err
        run = json.loads(result.out)
        assert run["summary"]["ok"] == 4 and run["config"]["tool_calls"] is True
        assert run["summary"]["tool_calls"] == {"steps": 4, "valid": 4, "valid_fraction": 1.0}
        for step in run["requests"]:
            [call] = step["tool_calls"]
            assert step["tool_call_valid"] and step["ttft_ms"] is not None
            assert call["name"] in ("read_file", "run_command", "search_code") and json.loads(call["arguments"])
        later = [r for r in run["requests"] if r["turn"] > 0]
        assert all(r["cached_tokens"] >= 16 for r in later)  # the answered call continued the conversation
    refused = sage("llm", "bench", "--url", server[0], "--workload", "agent", "--tool-calls")
    assert refused.code == 2 and "--tool-calls needs --api chat or --api responses" in refused.err
