import atexit
import os
import shutil
import tempfile

from hypothesis import HealthCheck, settings

# max_examples of a profile also scales the counts tests give (tests/_examples.py)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("compat", settings.get_profile("ci"), max_examples=20)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

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
