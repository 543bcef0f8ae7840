"""%tfmem and %%tfmem: the line parsed (magic_parsers.py), the core called, its result shown.

A subcommand that makes a result follows IPython's %timeit (_deliver): unless -q it is shown, -o
returns it, -v NAME stores it. A refusal of the core is one UsageError line that names the magic.
"""

from __future__ import annotations

from contextlib import contextmanager

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..errors import ArgumentError, FreshRunError, TfmemError
from ..oom.traced import trace
from ..readings.measure import measure
from ..readings.report import report
from ..tf.device_setup import setup
from ..tf.options import OPTION_NAMES
from .magic_parsers import help_text, magic_name, parse_cell, parse_line

# The core function behind a subcommand begins its refusals with its name; the magic's name says it instead.
_CORE_PREFIX = {"plan": "plan: ", "batch": "max_batch_size: ", "record": "record: "}


@contextmanager
def _one_line(magic: str, core_prefix: str = ""):
    """A refusal of the core (a bad argument, a setup TensorFlow's rules refuse, a state that forbids
    the call, a damaged trace, a fresh process that failed) as one UsageError line naming the magic."""
    try:
        yield
    except TfmemError as exc:
        raise UsageError(f"{magic}: {str(exc).removeprefix(core_prefix)}") from None


def _display(thing) -> None:
    from IPython.display import display

    display(thing)


def _show(result, args) -> None:
    """A result as the cell's Out would show it, without being Out: its rich view in a notebook, its text elsewhere."""
    _display(result)


def _show_oom(result, args) -> None:
    if result is None:
        print("no OOM explained in this process yet")
    else:
        _display(result)


def _setup_options(args) -> dict:
    """The setup options given (fresh, batch): the others stay as the new process finds them."""
    return {name: getattr(args, name) for name in OPTION_NAMES if getattr(args, name) is not None}


@magics_class
class TfmemMagics(Magics):
    @line_cell_magic
    def tfmem(self, line: str, cell: str | None = None):
        parsed = parse_line(line) if cell is None else parse_cell(line)
        if parsed is None:
            return None  # -h: its help was printed, nothing ran
        name, args = parsed
        work = getattr(self, f"_{name}")  # each subcommand and mode has the method named for it
        with _one_line(magic_name(name, cell is not None), _CORE_PREFIX.get(name, "")):
            result = work(args) if cell is None else work(args, cell)
        if not hasattr(args, "output"):
            return result  # watch, panel, record: a live object (a widget, the recorder), returned as it is
        show = {"trace": self._show_trace, "oom": _show_oom}.get(name, _show)
        return self._deliver(args, result, show)

    def _deliver(self, args, result, show):
        """-o, -q and -v NAME applied to a result, as IPython's %timeit applies them: the one place.
        -v NAME stores it in the user's namespace; unless -q it is shown; -o returns it (the cell's Out)."""
        if args.variable is not None:
            self.shell.user_ns[args.variable] = result
        if not args.quiet:
            show(result, args)
        return result if args.output else None

    # -- %tfmem: a subcommand per line ---------------------------------------------------------
    def _report(self, args):
        return report()

    def _setup(self, args):
        return setup(**{name: getattr(args, name) for name in OPTION_NAMES})

    def _watch(self, args):
        from ..tf.devices import resolve_device
        from .widgets.gauge import Gauge, stop_all

        if args.action == "stop":
            print(f"stopped {stop_all()} gauge(s)")
            return None
        device = resolve_device(args.device).name if args.device else None
        return Gauge(interval=args.interval, device=device)

    def _panel(self, args):
        from .widgets import SetupPanel

        search = None
        if args.search is not None:
            if args.search not in self.shell.user_ns:
                raise ArgumentError(f"--search: no variable {args.search!r} here; run %%tfmem batch -v NAME (or "
                                    "max_batch_size) first.")
            search = self.shell.user_ns[args.search]
        return SetupPanel(search=search)

    def _record(self, args):
        from ..tracing import recorder

        if args.action == "stop":
            stopped = recorder.stop()
            print("the recorder was not running" if stopped is None else repr(stopped))
            return None
        return recorder.record(args.window)

    def _oom(self, args):
        from ..oom.explain import last_oom

        return last_oom()

    def _plan(self, args):
        from ..plans.plan import plan

        values = []
        for what, text in (("model", args.model), ("sample", " ".join(args.sample))):
            try:
                values.append(self.shell.ev(text))
            except Exception as exc:
                raise ArgumentError(f"the {what} {text!r} could not be read here ({type(exc).__name__}: "
                                    f"{exc}).") from None
        return plan(*values, args.batch)

    def _guard(self, args):
        from .fit_hook import guard

        on = guard(args.action == "on")
        print("tfmem guard: " + ("on: each Keras fit is planned at its batch before its first step, and stopped where "
                                 "it cannot fit or would abort" if on else "off"))

    def _died(self, args):
        from ..deaths.record import deaths

        told = deaths(again=True)
        if not told:
            print("no kernel started in this folder died in the last week (one that exits normally leaves nothing)")
        for death in told:
            print(repr(death))

    # -- %%tfmem: a mode per cell --------------------------------------------------------------
    def _measure(self, args, cell: str):
        with measure(args.device) as measurement:
            outcome = self.shell.run_cell(cell, store_history=False)
        failure = outcome.error_before_exec or outcome.error_in_exec
        if failure is not None:
            measurement.error = type(failure).__name__
        return measurement

    def _trace(self, args, cell: str):
        block = trace(keep=args.keep)
        block.__enter__()
        outcome = None
        try:
            outcome = self.shell.run_cell(cell, store_history=False)
        finally:
            failure = None if outcome is None else (outcome.error_before_exec or outcome.error_in_exec)
            block.__exit__(type(failure) if failure else None, failure, None)  # a damaged trace file raises
        return block.result

    def _show_trace(self, result, args) -> None:
        _display(result)
        if result.allocators and getattr(self.shell, "kernel", None) is not None:
            from .widgets import MapViewer

            _display(MapViewer(result))  # in a notebook: the map, its slider, the OOM
        if args.plot and len(result.allocators):
            import matplotlib.pyplot as plt

            result.plot_map()
            result.plot_timeline()
            plt.show()

    def _fresh(self, args, cell: str):
        from ..fresh.run import run_fresh

        names = [name for name, _ in args.env]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ArgumentError(f"--env {twice[0]} given twice: give it once.")
        returns = list(dict.fromkeys(name for names in args.returns for name in names))
        try:
            run = run_fresh(cell, setup=_setup_options(args) or None, env=dict(args.env), returns=returns,
                            timeout=args.timeout, path=args.path)
        except FreshRunError as exc:
            if exc.oom is not None and not exc.oom_shown:
                _display(exc.oom)  # a child killed by its OOM: TensorFlow's dump of it, read here
            raise
        self.shell.user_ns.update(run.values)
        return run

    def _batch(self, args, cell: str):
        from ..search.batch_search import max_batch_size

        # The cell's functions are made in a namespace of their own (sent by value to each probe);
        # the kernel's names are readable from it, none is changed.
        namespace = dict(self.shell.user_ns)
        namespace["__name__"] = "__main__"
        try:
            exec(compile(cell, "<%%tfmem batch>", "exec"), namespace)
        except Exception as exc:
            raise ArgumentError(f"the cell raised {type(exc).__name__}: {exc}") from None
        missing = [name for name in ("build_model", "make_batch") if not callable(namespace.get(name))]
        if missing:
            raise ArgumentError(f"the cell must define {' and '.join(missing)}(): build_model() returns a compiled "
                                "Keras model, make_batch(n) one batch (x, y) of n examples.")
        return max_batch_size(namespace["build_model"], namespace["make_batch"], setup=_setup_options(args) or None,
                              method=args.method or "auto", low=args.low, high=args.high, steps=args.steps,
                              margin=args.margin, probe_timeout=args.timeout, env=dict(args.env))


TfmemMagics.tfmem.__doc__ = help_text()
