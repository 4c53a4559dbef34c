"""What every test run shares: the quick default run, hypothesis profiles, the XLA cache.

``python -m pytest`` with no paths (the README's command) is the **quick run**:
spread over pytest-xdist's workers (``-n auto``, one per core) unless ``-n`` is
given, without the tests marked ``slow`` (the notebooks, the benchmark suite, the
example scripts, the multi-process clusters), and with each property test drawing
a quarter of its examples (the hypothesis profile ``dev``). ``--full`` runs
everything with the full counts (profile ``ci``); CI passes ``-n 2 --full``.
Naming paths (``python -m pytest tests/test_flat.py``) runs all they hold, full
counts, in this process. ``HYPOTHESIS_PROFILE`` (or ``--hypothesis-profile``)
chooses the profile whatever the run.
"""

import atexit
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# max_examples of a profile also scales the counts tests give (tests/_examples.py)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("compat", settings.get_profile("ci"), max_examples=20)
settings.register_profile("dev", settings.get_profile("ci"), max_examples=25)

# Each distinct XLA program is compiled once per test session: JAX's persistent
# compilation cache in a fresh temporary directory, shared by the pytest-xdist workers
# and the processes tests start (through the environment). Many programs recur but for
# the Python function that traced them (hypothesis examples, fixtures set up again).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="sharetree-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="with no paths: also the tests marked slow, and full hypothesis counts (CI)",
    )


def quick(config: pytest.Config) -> bool:
    """Whether this is the quick run: no paths given (pyproject's ``testpaths``), no ``--full``."""
    no_paths = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    return no_paths and not config.getoption("--full", False)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which turns -n into workers
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The quick run is spread over ``-n auto`` workers where pytest-xdist is installed.

    Each test file goes to one worker (``--dist loadfile``), so that a module's fixture
    (a demo trained, a script run in a subprocess) is set up once, not once per worker.
    """
    if (
        quick(config)
        and config.pluginmanager.hasplugin("xdist")  # not under -p no:xdist
        and not hasattr(config, "workerinput")  # not in a worker: it runs what it is sent
        and config.option.numprocesses is None  # no -n given (-n 0: this process)
    ):
        config.option.numprocesses = "auto"
        if config.option.dist == "no":  # no --dist given
            config.option.dist = "loadfile"


def pytest_configure(config: pytest.Config) -> None:
    # before the test modules are imported: their @settings read the profile (_examples.py)
    if config.getoption("hypothesis_profile", None) is None:  # else hypothesis loads it
        default = "dev" if quick(config) else "ci"
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", default))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not quick(config):
        return
    skip = pytest.mark.skip(reason="slow: `python -m pytest --full` runs it (CI does)")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
