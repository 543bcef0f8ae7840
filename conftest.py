"""Set-up for the whole test run: notebook kernels (nbval) and the tests in tests/.

TensorFlow's C++ start-up lines ("Could not find cuda drivers...", with timestamps and
process ids) go to file descriptor 2 before its logging is configured, so no log level
hides them, and ipykernel forwards fd 2 into the notebook as stderr. They differ by
machine and run, so the kernels that record and check the workbook leave fd 2 alone;
Python's own stderr (warnings, tracebacks) is still captured and compared.
"""

import os

import pytest

from dev import quiet_kernel_environment

# nbval's kernels and the tests' fresh processes inherit this process's environment.
os.environ.update(quiet_kernel_environment())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """nbval starts each notebook's kernel in its first cell's setup: give it an environment
    without this process's lab-mode variables, so every notebook starts as a reader's would."""
    if not type(item).__module__.startswith("nbval"):
        yield
        return
    from tfmem_widgets.tf import device_setup
    from tfmem_widgets.tf.options import SETUP_ENV_VARS
    from tfmem_widgets.tf.runtime import ONEDNN_ENV

    # oneDNN's switch too where this process's lab setup made it (as a fresh process's environment drops it)
    names = (*SETUP_ENV_VARS, *([ONEDNN_ENV] if device_setup.onednn_switched_off else []))
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
