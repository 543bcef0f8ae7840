"""The package's errors by meaning: each is a TfmemError and the built-in a Python user would catch, and a
bad argument, a state that forbids the call and a setup TensorFlow's rules refuse each raise their own."""

import pytest

import tfmem_widgets
from conftest import search_functions
from tfmem_widgets import errors

# Each public error and the built-in it also is.
BUILT_IN = {"ArgumentError": ValueError, "SetupError": ValueError, "TraceDataError": ValueError,
            "StateError": RuntimeError, "NvmlUnavailable": RuntimeError, "FreshRunError": RuntimeError,
            "FitStopped": RuntimeError}


def test_each_public_error_is_a_tfmem_error_and_the_built_in_it_means():
    face = vars(tfmem_widgets)  # the module's own names (the widgets load only on first use)
    public = {name for name in tfmem_widgets.__all__
              if isinstance(face.get(name), type) and issubclass(face[name], BaseException)}
    defined = {name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, BaseException)}
    assert public == defined == {"TfmemError", *BUILT_IN}
    for name, built_in in BUILT_IN.items():
        kind = face[name]
        assert issubclass(kind, tfmem_widgets.TfmemError) and issubclass(kind, built_in), name
        assert not issubclass(kind, ValueError if built_in is RuntimeError else RuntimeError), name
    assert not issubclass(tfmem_widgets.TraceDataError, tfmem_widgets.SetupError)
    assert not issubclass(tfmem_widgets.ArgumentError, tfmem_widgets.SetupError)
    assert issubclass(tfmem_widgets.FitStopped, tfmem_widgets.StateError)  # a state (the guard's plan) forbids the fit


def test_a_bad_argument_a_forbidding_state_and_a_broken_rule_each_raise_their_class():
    for bad in (42, "", ValueError("not memory")):
        with pytest.raises(tfmem_widgets.ArgumentError, match="explain_oom: "):
            tfmem_widgets.explain_oom(bad)
    build_model, make_batch = search_functions()
    with pytest.raises(tfmem_widgets.ArgumentError, match=r"low \(8\) is above high \(4\)"):
        tfmem_widgets.max_batch_size(build_model, make_batch, low=8, high=4)
    with pytest.raises(ValueError, match="margin must be"):  # what a Python user would catch
        tfmem_widgets.max_batch_size(build_model, make_batch, margin=1.5)
    with tfmem_widgets.trace():
        with pytest.raises(tfmem_widgets.StateError, match="already running") as nested:
            with tfmem_widgets.trace():
                pass
    assert isinstance(nested.value, RuntimeError)
    # Growth off and forced on at once: refused by the rules, on a GPU as here without one (no GPU to apply it to).
    with pytest.raises(tfmem_widgets.SetupError) as refused:
        tfmem_widgets.setup(growth=False, force_growth=True)
    assert "\n" not in str(refused.value)
