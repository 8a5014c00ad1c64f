"""`/v1/responses` behind the routers: a stored response lives on the replica that created it, so continuing it,
retrieving it and deleting it must reach that replica. Real replicas on loopback, the official `openai` client,
a router restarted for real (a fresh one over the same replicas finds the response by asking)."""

from __future__ import annotations

import openai
import pytest

from tests.server_fixture import running_router, running_server
from tests.test_fleet_router import running_fleet
from tests.tiny_models import make_tiny_model

FIRST = "Tell me about the weather " + " ".join(f"fact{i}" for i in range(40))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fleet-responses") / "tiny-llama", "llama")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def create(url: str, **kwargs):
    model = client(url).models.list().data[0].id
    return client(url).responses.create(model=model, temperature=0, max_output_tokens=4, **kwargs)


def holder(replicas, response_id: str) -> list[str]:
    """The replicas that store `response_id` (asked directly)."""
    found = []
    for replica in replicas:
        try:
            client(replica.url).responses.retrieve(response_id)
            found.append(replica.url)
        except openai.NotFoundError:
            pass
    return found


def test_a_conversation_stays_on_the_replica_that_stores_it_across_a_router_restart(model_dir):
    with running_server(model_dir) as a, running_server(model_dir) as b:
        with running_fleet([a.url, b.url], routing="round-robin") as (url, router):
            first = create(url, input=FIRST)
            [owner] = holder((a, b), first.id)
            turn = first
            for i in range(3):  # round-robin would alternate: each turn goes where its conversation is stored
                turn = create(url, input=f"and then {i}?", previous_response_id=turn.id)
                assert holder((a, b), turn.id) == [owner]
            assert turn.usage.input_tokens_details.cached_tokens > 0  # the stored context's KV, on that replica
            streamed = list(client(url).responses.create(model=first.model, input=FIRST, max_output_tokens=4,
                                                         temperature=0, stream=True))
            streamed_id = streamed[0].response.id
            assert streamed[-1].type in ("response.completed", "response.incomplete")
            assert router.responses.owners.owner(streamed_id) in (a.url, b.url)  # learned from the stream
            with pytest.raises(openai.NotFoundError):
                create(url, input="x", previous_response_id="resp_unknown")
            other = openai.OpenAI(base_url=f"{url}/v1", api_key="another-tenant", max_retries=0)
            with pytest.raises(openai.NotFoundError):  # the client's token reaches the replica: its tenant
                other.responses.retrieve(first.id)
        with running_fleet([a.url, b.url], routing="round-robin") as (url, router):  # a new router knows nothing
            assert client(url).responses.retrieve(turn.id).id == turn.id
            items = client(url).responses.input_items.list(turn.id)  # from the replica that stores it
            assert items.data and any(getattr(item, "role", None) == "user" for item in items.data)
            again = create(url, input="once more?", previous_response_id=turn.id)
            assert holder((a, b), again.id) == [owner]
            client(url).responses.delete(again.id)
            assert holder((a, b), again.id) == []
            with pytest.raises(openai.NotFoundError):
                client(url).responses.retrieve(again.id)
            with pytest.raises(openai.NotFoundError):
                client(url).responses.retrieve("resp_unknown")


def test_the_pd_router_runs_a_conversation_whole_on_the_decode_worker_that_stores_it(model_dir):
    with running_server(model_dir) as a, running_server(model_dir) as b, running_router([], [a.url, b.url]) as url:
        first = create(url, input=FIRST)
        [owner] = holder((a, b), first.id)
        second = create(url, input="and then?", previous_response_id=first.id)
        assert holder((a, b), second.id) == [owner]
        assert client(url).responses.retrieve(second.id).output_text == second.output_text
