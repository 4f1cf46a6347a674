"""Shared fixtures: the real models (fetched into the goinfer cache by .ci/run) and tiny fixtures."""

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Two folders beside the repository that some tests read and a fresh clone does not have: the family kit (tiny
# models of every family with llama.cpp's and the f32 oracle's outputs) and ../shared/reference (llama.cpp's outputs
# on the two real models). Each is named by one setting, read here only (a relative path is taken from the
# repository root); every test file gets the paths from here. Where one is absent its tests skip, and the run ends
# with one line that says so (pytest_terminal_summary below); .ci/run sets both and fails without them.
KIT = ROOT / os.environ.get("GOINFER_KIT", "../shared/families")
REFERENCE = ROOT / os.environ.get("GOINFER_REFERENCE", "../shared/reference")
KIT_MISSING = f"family kit not found at {KIT.resolve()} (set GOINFER_KIT)"
REFERENCE_MISSING = f"reference outputs not found at {REFERENCE.resolve()} (set GOINFER_REFERENCE)"
HAVE_KIT = KIT.is_dir()
HAVE_REFERENCE = REFERENCE.is_dir()
needs_kit = pytest.mark.skipif(not HAVE_KIT, reason=KIT_MISSING)
needs_reference = pytest.mark.skipif(not HAVE_REFERENCE, reason=REFERENCE_MISSING)
# The quant kit: the kit's dense families requantized by llama.cpp into the low-bit types (Q2_K, IQ4_XS, TQ1_0...).
# Made here, not shipped (tens of MB): python testdata/make_quant_kit.py (its docstring says how).
QUANT_KIT = ROOT / os.environ.get("GOINFER_QUANT_KIT", "testdata/quant_kit")
QUANT_KIT_MISSING = (f"quant kit not found at {QUANT_KIT.resolve()} (set GOINFER_QUANT_KIT; "
                     "testdata/make_quant_kit.py makes it)")


# The chat page's tests in a real browser (tests/test_browser.py) need node, Debian's chromium (GOINFER_CHROMIUM names
# another) and tests/browser's npm packages; .ci/run installs all three and fails without them.
CHROMIUM = os.environ.get("GOINFER_CHROMIUM") or shutil.which("chromium") or ""
BROWSER_DIR = ROOT / "tests" / "browser"
BROWSER_MISSING = ("browser not found: the chat page's tests need node, chromium and `npm ci --prefix tests/browser`"
                   " (set GOINFER_CHROMIUM)")
HAVE_BROWSER = bool(shutil.which("node") and CHROMIUM and (BROWSER_DIR / "node_modules" / "playwright-core").is_dir())
needs_browser = pytest.mark.skipif(not HAVE_BROWSER, reason=BROWSER_MISSING)


def in_kit(*parts: str) -> Path:
    """A path in the family kit, for a test or fixture body: skips the test where the kit is absent."""
    if not HAVE_KIT:
        pytest.skip(KIT_MISSING)
    return KIT.joinpath(*parts)


def in_reference(*parts: str) -> Path:
    """A path in ../shared/reference (GOINFER_REFERENCE), as in_kit."""
    if not HAVE_REFERENCE:
        pytest.skip(REFERENCE_MISSING)
    return REFERENCE.joinpath(*parts)


def pytest_terminal_summary(terminalreporter):
    """One line where the kit, the reference outputs or the browser are absent: where, how many tests skipped, which
    setting."""
    skipped = [str(r.longrepr) for r in terminalreporter.stats.get("skipped", [])]
    counts = [(why, setting, sum(why in s for s in skipped)) for why, setting in
              ((KIT_MISSING, "GOINFER_KIT"), (REFERENCE_MISSING, "GOINFER_REFERENCE"),
               (QUANT_KIT_MISSING, "GOINFER_QUANT_KIT"), (BROWSER_MISSING, "GOINFER_CHROMIUM"))]
    missing = [f"{why.split(' (set ')[0]}: {n} tests skipped (set {setting})" for why, setting, n in counts if n]
    if missing:
        terminalreporter.write_line("; ".join(missing))

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
