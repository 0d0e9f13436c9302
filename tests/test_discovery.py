"""Discovery: parsing per server kind, precedence, failed probes and model choice."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from dsclient._http import httpx
from dsclient.client._discovery import (
    DEFAULT_MAX_NUM_SEQS,
    OLLAMA_DEFAULT_PARALLEL,
    ServerInfo,
    discover,
    parse_llamacpp_props,
    parse_models,
    parse_ollama_ps,
    parse_ollama_version,
    parse_sglang_loads,
    parse_sglang_server_info,
    parse_tgi_info,
    parse_version,
    parse_vllm_server_info,
    unreachable,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


URL = "http://server:8000"

# --- realistic payloads --------------------------------------------------------------------------
# vLLM 0.32.0 as measured here (ENVIRONMENT.md).
VLLM_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "tiny",
            "object": "model",
            "created": 1764668000,
            "owned_by": "vllm",
            "root": "/models/tiny",
            "parent": None,
            "max_model_len": 2048,
            "permission": [],
        }
    ],
}
VLLM_SERVER_INFO = {
    "vllm_config": {
        "model_config": {"model": "/models/tiny", "max_model_len": 2048, "dtype": "float32"},
        "scheduler_config": {"max_num_seqs": 8, "max_num_batched_tokens": 2048},
        "cache_config": {"block_size": 128},
    },
    "vllm_env": {},
    "system_env": {},
}
# sglang io_struct GetLoadsReqOutput, one per DP rank.
SGLANG_LOADS = {
    "version": "0.5.4",
    "timestamp": 1764668000.0,
    "loads": [
        {
            "dp_rank": 0,
            "timestamp": 1764668000.0,
            "num_running_reqs": 3,
            "num_waiting_reqs": 1,
            "num_used_tokens": 900,
            "max_total_num_tokens": 20480,
            "token_usage": 0.04,
            "max_running_requests": 48,
        },
        {"dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 0, "max_running_requests": 48},
    ],
}
SGLANG_SERVER_INFO = {
    "model_path": "qwen/qwen2.5-0.5b-instruct",
    "served_model_name": "qwen/qwen2.5-0.5b-instruct",
    "context_length": None,
    "max_running_requests": None,
    "dp_size": 1,
    "max_total_num_tokens": 20480,
    "max_req_input_len": 32762,
    "internal_states": [
        {"last_gen_throughput": 357.2, "effective_max_running_requests_per_dp": 128}
    ],
    "version": "0.5.4",
}
SGLANG_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "qwen/qwen2.5-0.5b-instruct",
            "object": "model",
            "owned_by": "sglang",
            "root": "qwen/qwen2.5-0.5b-instruct",
            "max_model_len": 32768,
        }
    ],
}
# TGI 3.2.1 /info as a user printed it.
TGI_INFO = {
    "model_id": "mistralai/Ministral-8B-Instruct-2410",
    "model_sha": "4847e87e5975a573a2a190399ca62cd266c899ad",
    "model_pipeline_tag": None,
    "max_concurrent_requests": 128,
    "max_best_of": 2,
    "max_stop_sequences": 4,
    "max_input_tokens": 32767,
    "max_total_tokens": 32768,
    "validation_workers": 2,
    "max_client_batch_size": 4,
    "router": "text-generation-router",
    "version": "3.2.1",
    "sha": "4d28897b4e345f4dfdd93d3434e50ac8afcdf9e1",
    "docker_label": "sha-4d28897",
}
TGI_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "mistralai/Ministral-8B-Instruct-2410",
            "object": "model",
            "created": 0,
            "owned_by": "mistralai/Ministral-8B-Instruct-2410",
        }
    ],
}
LLAMACPP_PROPS = {
    "default_generation_settings": {"n_ctx": 4096, "params": {"temperature": 0.8}},
    "total_slots": 4,
    "model_path": "models/qwen2.5-7b-instruct-q4_k_m.gguf",
    "chat_template": "...",
    "modalities": {"vision": False},
    "build_info": "b5120-abcdef12",
}
LLAMACPP_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "models/qwen2.5-7b-instruct-q4_k_m.gguf",
            "object": "model",
            "owned_by": "llamacpp",
            "meta": {"n_ctx_train": 32768},
        }
    ],
}
OLLAMA_MODELS = {
    "object": "list",
    "data": [{"id": "qwen3:8b", "object": "model", "created": 1, "owned_by": "library"}],
}
OLLAMA_PS = {
    "models": [
        {
            "name": "qwen3:8b",
            "model": "qwen3:8b",
            "size": 5_000_000_000,
            "digest": "abc",
            "expires_at": "2026-08-03T10:00:00Z",
            "size_vram": 4_600_000_000,
            "context_length": 8192,
        }
    ]
}

Routes = dict[str, Any]


def _transport(routes: Routes, seen: list[str] | None = None) -> httpx.MockTransport:
    """Answer GETs from ``routes`` (path -> JSON, an ``httpx.Response`` or an exception)."""

    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request.url.path)
        answer = routes.get(request.url.path)
        if answer is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, httpx.Response):
            return answer
        return httpx.Response(200, json=answer)

    return httpx.MockTransport(handler)


async def _discover(routes: Routes, **kwargs: Any) -> ServerInfo:
    kwargs.setdefault("records", None)
    async with httpx.AsyncClient(transport=_transport(routes)) as http:
        return await discover(http, URL, **kwargs)


VLLM: Routes = {
    "/v1/models": VLLM_MODELS,
    "/version": {"version": "0.32.0"},
    "/server_info": VLLM_SERVER_INFO,
}
VLLM_NO_DEV: Routes = {"/v1/models": VLLM_MODELS, "/version": {"version": "0.32.0"}}


# --- pure parsers --------------------------------------------------------------------------------
def test_parse_models_vllm() -> None:
    facts = parse_models(VLLM_MODELS)
    assert facts is not None
    assert facts.kind == "vllm"
    assert facts.models == ("tiny",)
    assert dict(facts.model_lens) == {"tiny": 2048}


def test_parse_models_ignores_foreign_owners_and_junk() -> None:
    assert parse_models(TGI_MODELS).kind is None  # type: ignore[union-attr]
    assert parse_models(OLLAMA_MODELS).kind is None  # type: ignore[union-attr]
    mixed = {"data": [{"id": "a", "owned_by": "vllm"}, {"id": "b", "owned_by": "sglang"}, 3]}
    assert parse_models(mixed) == parse_models(mixed)
    assert parse_models(mixed).kind is None  # type: ignore[union-attr]
    assert parse_models({"data": "nope"}) is None
    assert parse_models(["tiny"]) is None


def test_parse_vllm_server_info_object_and_string_forms() -> None:
    as_object = parse_vllm_server_info(VLLM_SERVER_INFO)
    as_string_value = parse_vllm_server_info(
        {"vllm_config": json.dumps(VLLM_SERVER_INFO["vllm_config"])}
    )
    as_string_body = parse_vllm_server_info(json.dumps(VLLM_SERVER_INFO))
    for facts in (as_object, as_string_value, as_string_body):
        assert facts is not None
        assert (facts.kind, facts.max_num_seqs, facts.max_model_len) == ("vllm", 8, 2048)


def test_parse_vllm_server_info_text_form() -> None:
    text = "model='/models/tiny', speculative_config=None, max_seq_len=2048, max_num_seqs=16, x=1"
    facts = parse_vllm_server_info({"vllm_config": text})
    assert facts is not None
    assert (facts.max_num_seqs, facts.max_model_len) == (16, 2048)
    assert parse_vllm_server_info({"vllm_config": "nothing useful"}).max_num_seqs is None  # type: ignore[union-attr]
    assert parse_vllm_server_info(SGLANG_SERVER_INFO) is None
    assert parse_vllm_server_info("not json") is None


def test_parse_version() -> None:
    assert parse_version({"version": "0.32.0"}).version == "0.32.0"  # type: ignore[union-attr]
    assert parse_version({"version": 3}) is None
    assert parse_ollama_version({"version": "0.5.7"}).kind == "ollama"  # type: ignore[union-attr]


def test_parse_sglang_loads_sums_dp_ranks() -> None:
    facts = parse_sglang_loads(SGLANG_LOADS)
    assert facts is not None
    assert (facts.kind, facts.version) == ("sglang", "0.5.4")
    assert (facts.max_num_seqs, facts.num_running, facts.num_waiting) == (96, 5, 1)
    bare = parse_sglang_loads([{"num_running_reqs": 0, "max_running_requests": 8}])
    assert bare is not None and bare.max_num_seqs == 8
    assert parse_sglang_loads({"loads": []}) is None
    assert parse_sglang_loads({"server_load": 3}) is None  # vLLM's /load, not this


def test_parse_sglang_server_info() -> None:
    facts = parse_sglang_server_info(SGLANG_SERVER_INFO)
    assert facts is not None
    assert facts.max_num_seqs == 128  # the effective value, not the null argument
    assert facts.max_model_len is None
    assert facts.max_input_tokens == 32762
    assert facts.model == "qwen/qwen2.5-0.5b-instruct"
    two_dp = {**SGLANG_SERVER_INFO, "dp_size": 2}
    assert parse_sglang_server_info(two_dp).max_num_seqs == 256  # type: ignore[union-attr]
    old = {"model_path": "m", "max_running_requests": 64, "context_length": 4096}
    assert parse_sglang_server_info(old).max_num_seqs == 64  # type: ignore[union-attr]
    assert parse_sglang_server_info(VLLM_SERVER_INFO) is None
    assert parse_sglang_server_info({"detail": "Not Found"}) is None


def test_parse_tgi_info() -> None:
    facts = parse_tgi_info(TGI_INFO)
    assert facts is not None
    assert (facts.kind, facts.version, facts.model) == (
        "tgi",
        "3.2.1",
        "mistralai/Ministral-8B-Instruct-2410",
    )
    # max_concurrent_requests is where TGI refuses (429), not its batch: a hard cap.
    assert (facts.max_num_seqs, facts.max_model_len, facts.max_input_tokens) == (None, 32768, 32767)
    assert facts.max_concurrent == 128
    old = {"model_id": "gpt2", "max_concurrent_requests": 128, "max_input_length": 1000}
    assert parse_tgi_info(old).max_input_tokens == 1000  # type: ignore[union-attr]
    assert parse_tgi_info({**TGI_INFO, "max_batch_size": 32}).max_num_seqs == 32  # type: ignore[union-attr]
    assert parse_tgi_info({"version": "1"}) is None


def test_parse_llamacpp_props() -> None:
    facts = parse_llamacpp_props(LLAMACPP_PROPS)
    assert facts is not None
    assert (facts.kind, facts.max_num_seqs, facts.max_model_len) == ("llamacpp", 4, 4096)
    assert facts.version == "b5120-abcdef12"
    assert parse_llamacpp_props({"n_ctx": 3}) is None


def test_parse_ollama_ps() -> None:
    facts = parse_ollama_ps(OLLAMA_PS)
    assert facts is not None and dict(facts.model_lens) == {"qwen3:8b": 8192}
    assert parse_ollama_ps({"models": [{"name": "old:latest", "size_vram": 1}]}).model_lens == {}  # type: ignore[union-attr]
    assert parse_ollama_ps({"error": "x"}) is None


def test_parsers_reject_booleans_and_nonpositive_counts() -> None:
    assert parse_llamacpp_props({"total_slots": True}).max_num_seqs is None  # type: ignore[union-attr]
    assert parse_tgi_info({"max_concurrent_requests": 0}).max_num_seqs is None  # type: ignore[union-attr]


# --- discovery per server kind -------------------------------------------------------------------
async def test_vllm_dev_mode() -> None:
    info = await _discover(VLLM)
    assert (info.kind, info.version, info.model, info.models) == (
        "vllm",
        "0.32.0",
        "tiny",
        ("tiny",),
    )
    assert (info.max_model_len, info.max_num_seqs, info.has_tokenize) == (2048, 8, True)
    assert dict(info.sources) == {
        "kind": "/v1/models owned_by",
        "version": "vllm /version",
        "model": "/v1/models",
        "max_model_len": "/v1/models",
        "max_num_seqs": "vllm /server_info",
        "priority": "vllm /version (V1 engine: accepted, honoured if its policy is)",
    }
    assert (info.priority, info.priority_honoured) == ("lower-first", None)
    assert info.url == URL


async def test_vllm_without_dev_mode_falls_back_to_the_default() -> None:
    info = await _discover(VLLM_NO_DEV)
    assert info.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert info.sources["max_num_seqs"] == "default"
    assert info.max_model_len == 2048


async def test_sglang() -> None:
    info = await _discover(
        {
            "/v1/models": SGLANG_MODELS,
            "/v1/loads": SGLANG_LOADS,
            "/server_info": SGLANG_SERVER_INFO,
        }
    )
    assert (info.kind, info.version, info.has_tokenize) == ("sglang", "0.5.4", False)
    assert info.max_num_seqs == 96
    assert info.sources["max_num_seqs"] == "sglang /v1/loads"
    assert info.max_model_len == 32768
    assert info.max_input_tokens == 32762


async def test_old_sglang_get_server_info() -> None:
    old = {"model_path": "m", "max_running_requests": 64, "context_length": 4096, "version": "0.3"}
    info = await _discover({"/get_server_info": old})
    assert (info.kind, info.version, info.max_num_seqs, info.max_model_len) == (
        "sglang",
        "0.3",
        64,
        4096,
    )
    assert info.sources["max_num_seqs"] == "sglang /get_server_info"
    assert info.model is None  # no listing: nothing to choose from


async def test_tgi() -> None:
    info = await _discover({"/v1/models": TGI_MODELS, "/info": TGI_INFO})
    assert (info.kind, info.version) == ("tgi", "3.2.1")
    assert info.model == "mistralai/Ministral-8B-Instruct-2410"
    assert (info.max_num_seqs, info.max_model_len, info.max_input_tokens) == (8, 32768, 32767)
    assert info.sources["max_num_seqs"] == "default"  # TGI states no batch, only a hard cap
    assert (info.max_concurrent, info.sources["max_concurrent"]) == (128, "tgi /info")
    assert "128 (hard cap: refused past it)" in str(info)
    assert info.sources["max_model_len"] == "tgi /info"


async def test_llamacpp() -> None:
    info = await _discover({"/v1/models": LLAMACPP_MODELS, "/props": LLAMACPP_PROPS})
    assert (info.kind, info.max_num_seqs, info.max_model_len) == ("llamacpp", 4, 4096)
    assert info.sources["kind"] == "/v1/models owned_by"
    assert info.sources["max_model_len"] == "llama.cpp /props"


async def test_ollama() -> None:
    info = await _discover(
        {"/v1/models": OLLAMA_MODELS, "/api/version": {"version": "0.5.7"}, "/api/ps": OLLAMA_PS}
    )
    assert (info.kind, info.version, info.model) == ("ollama", "0.5.7", "qwen3:8b")
    assert info.max_num_seqs == OLLAMA_DEFAULT_PARALLEL
    assert info.sources["max_num_seqs"] == "ollama default"
    assert (info.max_model_len, info.sources["max_model_len"]) == (8192, "ollama /api/ps")


async def test_plain_openai_compatible_and_nothing_at_all() -> None:
    info = await _discover({"/v1/models": TGI_MODELS})
    assert info.kind == "openai-compatible"
    assert info.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    nothing = await _discover({})
    assert (nothing.kind, nothing.model, nothing.models, nothing.max_model_len) == (
        "unknown",
        None,
        (),
        None,
    )
    assert dict(nothing.sources) == {"max_num_seqs": "default", "/v1/models": "answered HTTP 404"}


# --- precedence ----------------------------------------------------------------------------------
class FakeRecords:
    def __init__(self, record: Any, matches: bool = True) -> None:
        self.record, self.matches = record, matches
        self.read: list[str] = []
        self.checked: list[Any] = []

    def read_record(self, url: str) -> Any:
        self.read.append(url)
        return self.record

    def record_matches(self, record: Any, models_json: dict[str, Any]) -> bool:
        self.checked.append(models_json)
        return self.matches


RECORD = SimpleNamespace(max_num_seqs=32, max_model_len=4096, model="tiny")


async def test_explicit_beats_everything() -> None:
    info = await _discover(VLLM, max_num_seqs=3, max_model_len=1000, records=FakeRecords(RECORD))
    assert (info.max_num_seqs, info.max_model_len) == (3, 1000)
    assert info.sources["max_num_seqs"] == info.sources["max_model_len"] == "explicit"


async def test_record_beats_server_info() -> None:
    records = FakeRecords(RECORD)
    info = await _discover(VLLM, records=records)
    assert (info.max_num_seqs, info.sources["max_num_seqs"]) == (32, "launcher record")
    # The live listing still wins for the context.
    assert (info.max_model_len, info.sources["max_model_len"]) == (2048, "/v1/models")
    assert records.read == [URL]
    assert records.checked == [VLLM_MODELS]


async def test_record_context_used_when_the_server_tells_none() -> None:
    routes = {"/v1/models": {"data": [{"id": "tiny", "owned_by": "vllm"}]}}
    info = await _discover(routes, records=FakeRecords(RECORD))
    assert (info.max_model_len, info.sources["max_model_len"]) == (4096, "launcher record")


async def test_stale_record_is_ignored() -> None:
    info = await _discover(VLLM, records=FakeRecords(RECORD, matches=False))
    assert (info.max_num_seqs, info.sources["max_num_seqs"]) == (8, "vllm /server_info")


async def test_record_is_ignored_when_models_cannot_confirm_it() -> None:
    records = FakeRecords(RECORD)
    info = await _discover({"/server_info": VLLM_SERVER_INFO}, records=records)
    assert info.sources["max_num_seqs"] == "vllm /server_info"
    assert records.checked == []


async def test_broken_record_source_is_ignored() -> None:
    class Broken(FakeRecords):
        def read_record(self, url: str) -> Any:
            raise OSError("disk on fire")

    info = await _discover(VLLM, records=Broken(RECORD))
    assert info.sources["max_num_seqs"] == "vllm /server_info"


async def test_auto_records_without_a_record_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("DSCLIENT_STATE_DIR", str(tmp_path))
    info = await _discover(VLLM, records="auto")
    assert info.sources["max_num_seqs"] == "vllm /server_info"


async def test_server_info_beats_sglang_and_tgi_and_llamacpp() -> None:
    # Nonsense mix, but it pins the order of the chain.
    routes = {
        "/server_info": VLLM_SERVER_INFO,
        "/v1/loads": SGLANG_LOADS,
        "/info": TGI_INFO,
        "/props": LLAMACPP_PROPS,
    }
    info = await _discover(routes)
    assert info.sources["max_num_seqs"] == "vllm /server_info"
    del routes["/server_info"]
    assert (await _discover(routes)).sources["max_num_seqs"] == "sglang /v1/loads"
    del routes["/v1/loads"]
    routes["/info"] = {**TGI_INFO, "max_batch_size": 32}
    assert (await _discover(routes)).sources["max_num_seqs"] == "tgi /info"
    del routes["/info"]
    assert (await _discover(routes)).sources["max_num_seqs"] == "llama.cpp /props"


# --- failed probes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "failure",
    [
        httpx.Response(404, json={"detail": "Not Found"}),
        httpx.Response(401, json={"error": "Unauthorized"}),
        httpx.Response(500, text="Internal Server Error"),
        httpx.Response(200, text="<html>not json</html>"),
        httpx.Response(200, content=b"\xff\xfe\x00garbage"),
        httpx.ConnectError("Connection refused"),
        httpx.ReadTimeout("timed out"),
    ],
    ids=["404", "401", "500", "html", "bad-bytes", "refused", "timeout"],
)
async def test_failed_probes_are_skipped(failure: Any) -> None:
    routes = dict(VLLM_NO_DEV)
    routes["/server_info"] = failure
    routes["/v1/loads"] = failure
    routes["/info"] = failure
    info = await _discover(routes)
    assert (info.kind, info.model, info.max_model_len) == ("vllm", "tiny", 2048)
    assert info.sources["max_num_seqs"] == "default"


async def test_every_probe_refused_is_unknown_not_an_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        info = await discover(http, URL, records=None)
    assert info.kind == "unknown"
    assert info.max_num_seqs == DEFAULT_MAX_NUM_SEQS


async def test_probes_run_concurrently_within_the_timeout() -> None:
    import anyio

    class Slow(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            await anyio.sleep(0.2)
            return httpx.Response(404)

    async with httpx.AsyncClient(transport=Slow()) as http:
        start = anyio.current_time()
        await discover(http, URL, records=None, timeout=1.0)
        elapsed = anyio.current_time() - start
    assert elapsed < 0.6  # nine probes of 0.2 s each, at the same time


async def test_a_hanging_probe_is_cut_at_the_timeout() -> None:
    import anyio

    class Hang(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/models":
                return httpx.Response(200, json=VLLM_MODELS)
            await anyio.sleep(30)
            return httpx.Response(404)

    async with httpx.AsyncClient(transport=Hang()) as http:
        with anyio.fail_after(2):
            info = await discover(http, URL, records=None, timeout=0.1)
    assert info.model == "tiny"


async def test_url_is_normalised_and_requests_go_under_the_root() -> None:
    seen: list[str] = []
    async with httpx.AsyncClient(transport=_transport(VLLM, seen)) as http:
        info = await discover(http, URL + "/v1/", records=None)
    assert info.url == URL
    assert "/v1/models" in seen and "/server_info" in seen
    assert not any(path.startswith("/v1/v1") for path in seen)


# --- model choice --------------------------------------------------------------------------------
TWO_MODELS = {
    "data": [
        {"id": "base", "owned_by": "vllm", "max_model_len": 4096},
        {"id": "lora-a", "owned_by": "vllm", "max_model_len": 4096},
    ]
}


async def test_several_models_and_none_chosen_is_a_value_error() -> None:
    with pytest.raises(
        ValueError, match="serves 2 models; choose one with model=: 'base', 'lora-a'"
    ):
        await _discover({"/v1/models": TWO_MODELS})


async def test_choosing_one_of_several() -> None:
    info = await _discover({"/v1/models": TWO_MODELS}, model="lora-a")
    assert (info.model, info.models, info.max_model_len) == ("lora-a", ("base", "lora-a"), 4096)
    assert info.sources["model"] == "explicit"


async def test_unlisted_model_is_a_value_error_listing_what_is_served_when_asked() -> None:
    with pytest.raises(ValueError, match=r"'nope' is not served .* it serves: 'tiny'"):
        await _discover(VLLM, model="nope", unlisted="raise")


async def test_unlisted_model_named_by_the_caller_is_tried_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # transformers' server lists only its Hugging Face cache and loads others on demand; a
    # gateway may route names it does not list.
    caplog.set_level(logging.WARNING, logger="dsclient")
    info = await _discover(VLLM, model="local/m")
    assert info.model == "local/m" and info.models == ("tiny",)
    assert info.sources["model"] == "explicit (not listed by /v1/models)"
    assert "does not list model 'local/m' (it lists: 'tiny'); trying it anyway" in caplog.text
    empty = await _discover({"/v1/models": {"object": "list", "data": []}}, model="local/m")
    assert empty.model == "local/m"


async def test_given_model_kept_when_there_is_no_listing() -> None:
    info = await _discover({"/info": TGI_INFO}, model="whatever")
    assert (info.model, info.sources["model"], info.models) == ("whatever", "explicit", ())


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
async def test_bad_explicit_limits(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1"):
        await _discover(VLLM, max_num_seqs=bad)


# --- the result object ---------------------------------------------------------------------------
async def test_server_info_str_and_dict() -> None:
    info = await _discover(VLLM)
    table = str(info)
    assert "max_num_seqs" in table and "(vllm /server_info)" in table
    assert table.splitlines()[0].split() == ["url", URL]
    data = info.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["models"] == ["tiny"] and data["sources"]["max_num_seqs"] == "vllm /server_info"


def test_server_info_is_frozen_and_validated() -> None:
    info = ServerInfo(url=URL, kind="unknown", sources={"max_num_seqs": "default"})
    with pytest.raises(AttributeError):
        info.kind = "vllm"  # type: ignore[misc]
    with pytest.raises(TypeError):
        info.sources["kind"] = "x"  # type: ignore[index]
    with pytest.raises(ValueError, match="max_num_seqs"):
        ServerInfo(url=URL, kind="unknown", max_num_seqs=0)
    with pytest.raises(TypeError):
        ServerInfo(URL, "unknown")  # type: ignore[misc]


# --- hostile answers (each found by tests/test_fuzz.py) ------------------------------------------
async def test_a_zero_max_num_seqs_in_the_text_config_is_not_taken() -> None:
    # Found: "max_num_seqs=0" in vLLM's text form became max_num_seqs 0, and ServerInfo raised
    # ValueError out of discover(); "max_model_len" 0 was reported as a context of 0.
    facts = parse_vllm_server_info({"vllm_config": "max_num_seqs=0, max_model_len=0"})
    assert facts is not None and facts.max_num_seqs is None and facts.max_model_len is None
    info = await _discover({**VLLM_NO_DEV, "/server_info": {"vllm_config": "max_num_seqs=0"}})
    assert info.max_num_seqs == DEFAULT_MAX_NUM_SEQS and info.sources["max_num_seqs"] == "default"


def test_a_count_of_thousands_of_digits_is_not_taken() -> None:
    # Found: int() of 5000 digits raises ValueError ("Exceeds the limit (4300 digits)").
    facts = parse_vllm_server_info({"vllm_config": "max_num_seqs=" + "9" * 5000})
    assert facts is not None and facts.max_num_seqs is None


async def test_an_absurd_limit_is_not_taken() -> None:
    # Found: TGI's max_concurrent_requests of 10**400 became max_num_seqs, and seeding the
    # endpoint with it raised OverflowError (int too large to convert to float).
    from dsclient.governor._endpoint import ControlOptions, Endpoint

    assert parse_tgi_info({"max_concurrent_requests": 10**400}).max_num_seqs is None  # type: ignore[union-attr]
    assert (
        parse_sglang_loads(
            {"loads": [{"num_running_reqs": 1, "max_running_requests": 2**31}] * 2}
        ).max_num_seqs
        is None
    )  # type: ignore[union-attr]
    info = await _discover(
        {"/info": {"max_concurrent_requests": 10**400, "max_total_tokens": 10**400}}
    )
    assert info.max_num_seqs == DEFAULT_MAX_NUM_SEQS and info.max_model_len is None
    endpoint = Endpoint(URL, ControlOptions(), {}, start=1)
    endpoint.seed(info, None)
    assert endpoint.governor.limit == 1  # nothing sensible stated: a black box's start


async def test_json_nested_past_the_recursion_limit_is_no_answer() -> None:
    # Found: the decoder raises RecursionError, not ValueError, on "[[[[..." of 50 000
    # brackets; it escaped _get_json and discover() (inside an ExceptionGroup). The string form
    # of vllm_config (decoded by _maybe_json) had the same hole.
    deep = httpx.Response(200, content=b"[" * 50_000)
    info = await _discover({**VLLM_NO_DEV, "/server_info": deep, "/v1/loads": deep})
    assert info.kind == "vllm" and info.model == "tiny"
    facts = parse_vllm_server_info({"vllm_config": "[" * 50_000})  # read as the text form
    assert facts is not None and facts.max_num_seqs is None and facts.max_model_len is None
    assert parse_vllm_server_info("{" + '"a":{' * 50_000) is None


async def test_a_probe_answer_in_an_odd_charset_or_encoding_is_read_as_utf8_or_skipped() -> None:
    # Kept when probes moved from response.json() to a capped read: JSON is read as UTF-8
    # whatever charset is named, and a body that fails its Content-Encoding tells nothing.
    body = json.dumps(VLLM_MODELS).encode()
    info = await _discover(
        {
            "/v1/models": httpx.Response(
                200, content=body, headers={"content-type": "application/json; charset=rot13"}
            ),
            "/version": httpx.Response(
                200, stream=httpx.ByteStream(b"{}"), headers={"content-encoding": "gzip"}
            ),
        }
    )
    assert info.model == "tiny" and info.version is None


# --- the server's own priority -------------------------------------------------------------------
def _dev_mode(policy: str) -> dict[str, Any]:
    return {
        "vllm_config": {
            "scheduler_config": {"max_num_seqs": 8, "policy": policy},
            "model_config": {"max_model_len": 2048},
        }
    }


@pytest.mark.parametrize(("policy", "honoured"), [("priority", True), ("fcfs", False)])
async def test_vllm_dev_mode_tells_whether_priority_is_honoured(
    policy: str, honoured: bool
) -> None:
    routes = {**VLLM, "/server_info": _dev_mode(policy)}
    info = await _discover(routes)
    assert (info.priority, info.priority_honoured) == ("lower-first", honoured)
    assert info.sources["priority"] == "vllm /server_info"
    assert "priority" in str(info)


async def test_priority_is_not_sent_where_the_server_is_not_known_to_take_it() -> None:
    # A vLLM behind a gateway that routes only /v1/*: no version, so no knowing its engine.
    gateway = {"/v1/models": VLLM["/v1/models"]}
    info = await _discover(gateway)
    assert info.kind == "vllm" and info.priority is None
    old = await _discover({**gateway, "/version": {"version": "0.6.3"}})
    assert old.priority is None  # V0 refused a non-zero priority on a first-come server
    tgi = await _discover({"/info": TGI_INFO})
    assert tgi.priority is None


async def test_the_callers_word_on_priority_wins() -> None:
    gateway = {"/v1/models": VLLM["/v1/models"]}
    told = await _discover(gateway, priority=True)
    assert (told.priority, told.priority_honoured, told.sources["priority"]) == (
        "lower-first",
        True,
        "explicit",
    )
    never = await _discover(VLLM, priority=False)
    assert (never.priority, never.priority_honoured) == (None, False)


def test_sglang_server_info_priority_scheduling() -> None:
    on = parse_sglang_server_info({"max_running_requests": 8, "enable_priority_scheduling": True})
    assert on is not None and (on.priority_order, on.priority_honoured) == ("higher-first", True)
    low = parse_sglang_server_info(
        {
            "max_running_requests": 8,
            "enable_priority_scheduling": True,
            "schedule_low_priority_values_first": True,
        }
    )
    assert low is not None and low.priority_order == "lower-first"
    off = parse_sglang_server_info({"max_running_requests": 8, "enable_priority_scheduling": False})
    assert off is not None and (off.priority_order, off.priority_honoured) == (None, False)


# --- what a failed listing says (issue 45: a typo'd port, a host that does not resolve) --------
def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed on leaving: nothing listens there now


@pytest.mark.anyio
async def test_a_port_where_nothing_listens_is_named_as_such() -> None:
    # The real HTTP stack, a real refused connection: the words come from the errno, wrapped.
    port = _closed_port()
    async with httpx.AsyncClient() as http:
        info = await discover(http, f"http://127.0.0.1:{port}", records=None)
    assert info.kind == "unknown" and not info.complete
    assert info.sources["/v1/models"] == f"nothing listens on 127.0.0.1:{port} (connection refused)"


@pytest.mark.anyio
async def test_a_host_that_does_not_resolve_is_named_as_such() -> None:
    async with httpx.AsyncClient() as http:
        info = await discover(http, "http://no-such-host.invalid:8000", records=None)
    assert info.sources["/v1/models"].startswith("no such host 'no-such-host.invalid'")


@pytest.mark.anyio
async def test_a_listing_that_answers_html_says_what_it_answered() -> None:
    page = httpx.Response(
        200, headers={"content-type": "text/html"}, text="<!DOCTYPE html><p>Welcome to nginx!"
    )
    info = await _discover({"/v1/models": page})
    assert not info.complete
    assert info.sources["/v1/models"] == (
        "answered HTTP 200 text/html, not JSON: '<!DOCTYPE html><p>Welcome to nginx!'"
    )


def test_unreachable_reads_the_cause_chain() -> None:
    import socket

    refused = httpx.ConnectError("cannot connect")
    refused.__cause__ = ConnectionRefusedError(111, "Connect call failed")
    assert (
        unreachable(refused, "http://h:8001/v1/models")
        == "nothing listens on h:8001 (connection refused)"
    )
    dns = httpx.ConnectError("cannot connect")
    dns.__cause__ = socket.gaierror(-2, "Name or service not known")
    assert unreachable(dns, "https://x.test/v1/models") == (
        "no such host 'x.test' (the name does not resolve: Name or service not known)"
    )
    slow = httpx.ConnectTimeout("connecting timed out")
    assert (
        unreachable(slow, "http://10.0.0.1:80/")
        == "10.0.0.1:80 did not answer in time (ConnectTimeout)"
    )


@pytest.mark.anyio
async def test_what_a_listing_answered_never_shows_the_api_key() -> None:
    def echo(request: httpx.Request) -> httpx.Response:
        page = f"<pre>GET /v1/models Authorization: {request.headers.get('authorization')}</pre>"
        return httpx.Response(200, headers={"content-type": "text/html"}, text=page)

    headers = {"Authorization": "Bearer sk-secret-123456"}
    async with httpx.AsyncClient(transport=httpx.MockTransport(echo), headers=headers) as http:
        info = await discover(http, URL, records=None)
    said = info.sources["/v1/models"]
    assert "sk-secret-123456" not in said and "Bearer ***" in said
