"""Every private API of another library that the code uses (docs/private-apis.md), imported as the
code imports it, with the names and parameters the code relies on. An upgrade that moves one fails
here, naming the library's version, the symbol and the file that uses it."""

from __future__ import annotations

import importlib
import inspect
import platform
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _symbol(library: str, path: str, user: str):
    module_name, _, name = path.rpartition(".")
    version = importlib.import_module(library).__version__
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{library} {version} moved {path}, which {user} uses (docs/private-apis.md): {e}")


def _params(fn, *names: str, library: str, user: str) -> None:
    missing = set(names) - set(inspect.signature(fn).parameters)
    version = importlib.import_module(library).__version__
    assert not missing, f"{library} {version}: {fn.__qualname__} lost parameters {missing}, which {user} passes"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="vLLM's CPU build is installed on x86-64 only (Makefile)")
def test_vllms_layerwise_reload_and_engine_are_where_the_vllm_backend_reaches_them():
    user = "producers/generate/vllm.py"
    reload_weights = _symbol("vllm", "vllm.model_executor.model_loader.reload.inplace.reload_weights", user)
    _params(reload_weights, "weights_iterator", "weights_path", "is_checkpoint_format", library="vllm", user=user)
    _symbol("vllm", "vllm.model_executor.model_loader.reload.layerwise.record_metadata_for_reloading", user)
    embedding = _symbol("vllm", "vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod", user)
    assert callable(getattr(embedding, "process_weights_after_loading", None)), "vllm: no process_weights_after_loading"
    engine = _symbol("vllm", "vllm.v1.engine.async_llm.AsyncLLM", user)
    assert callable(getattr(engine, "collective_rpc", None)), "vllm: AsyncLLM.collective_rpc is gone"
    _symbol("vllm", "vllm.config.set_current_vllm_config", user)


def test_uvicorns_h11_protocol_has_what_the_http_server_overrides():
    user = "schemas/http.py"
    protocol = _symbol("uvicorn", "uvicorn.protocols.http.h11_impl.H11Protocol", user)
    phrases = _symbol("uvicorn", "uvicorn.protocols.http.h11_impl.STATUS_PHRASES", user)
    assert phrases[400] == b"Bad Request", "uvicorn: STATUS_PHRASES changed shape"
    from schemas.http import _Protocol
    overridden = {n for n, v in vars(_Protocol).items() if callable(v) and not n.startswith("_")}
    assert overridden <= set(dir(protocol)), f"uvicorn: H11Protocol no longer has {overridden - set(dir(protocol))}"


def test_torch_dynamos_switch_exists():
    import torch._dynamo

    assert isinstance(getattr(torch._dynamo.config, "disable", None), bool), \
        f"torch {importlib.import_module('torch').__version__}: torch._dynamo.config.disable is gone"


def test_the_list_names_every_private_import_in_the_product_code():
    """A private import added without a line in docs/private-apis.md fails here."""
    listed = (ROOT / "docs" / "private-apis.md").read_text()
    private = re.compile(r"^\s*(?:from|import) ((?:vllm|uvicorn|torch|transformers|faust|aiokafka|starlette)"
                         r"[\w.]*\._[a-z][\w.]*|(?:vllm|uvicorn|torch)\.[\w.]*(?:reload|h11_impl)[\w.]*)", re.M)
    found = {(m.group(1), str(p.relative_to(ROOT))) for d in ("schemas", "learner", "producers", "consumers", "sao")
             for p in (ROOT / d).rglob("*.py") for m in private.finditer(p.read_text())}
    assert found, "the pattern finds nothing: it is broken"
    unlisted = {(name, where) for name, where in found if name.split(".")[-1] not in listed and name not in listed}
    assert not unlisted, f"private imports not in docs/private-apis.md: {unlisted}"
