"""Shared fixtures: the real models (fetched into the goinfer cache by .ci/run) and tiny fixtures."""

import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
REFERENCE = SHARED / "reference"

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"


def _cached_model(name: str, filename: str) -> Path:
    home = Path(os.environ.get("GOINFER_HOME", Path.home() / ".cache" / "goinfer"))
    path = home / "models" / name / filename
    if not path.exists():
        pytest.fail(f"{path} missing: run `goinfer pull {name}` (.ci/run does) before the tests")
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return _cached_model("smollm2-135m", SMOLLM2_FILE)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    return _cached_model("gemma3-270m", GEMMA_FILE)


SERVER_KEY = "goinfer-test-key"


# The SDK test modules (anthropic, responses, structured) share one keyed server through these fixtures;
# test_server.py defines its own `server`, `name` and `client` (other options), and test_anthropic.py its own
# `client` (the anthropic SDK): module fixtures override these.


@pytest.fixture(scope="session")
def server(tmp_path_factory, smollm2_gguf):
    """One `goinfer serve` on the real default model, with an API key, shared by the SDK test modules."""
    from tests.test_server import start_server, stop

    s = start_server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", str(smollm2_gguf),
                     "--api-key", SERVER_KEY)
    yield s
    stop(s)


@pytest.fixture(scope="session")
def name(smollm2_gguf) -> str:
    """The model name the shared server serves."""
    return smollm2_gguf.stem


@pytest.fixture(scope="session")
def client(server):
    """The official openai SDK pointed at the shared server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=SERVER_KEY, max_retries=0, timeout=300)
