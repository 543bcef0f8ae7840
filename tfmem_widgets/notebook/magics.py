"""%tfmem and %%tfmem: thin argument parsing around the core; results are objects."""

from __future__ import annotations

import argparse
import os

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import MagicArgumentParser
from IPython.utils.process import arg_split

from ..errors import ArgumentError, TfmemError, TraceDataError
from ..oom.traced import trace
from ..readings.measure import measure
from ..readings.report import report
from ..tf.device_setup import setup
from ..tf.options import OPTION_NAMES, SETUP_OPTIONS


def _typed(parse):
    """A setup option's parser as an argparse type: its refusal becomes the option's error."""

    def parse_text(text: str):
        try:
            return parse(text)
        except ArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse_text.__name__ = parse.__name__
    return parse_text



def _core_check(check, read=float, what="seconds"):
    """An argparse type: the text read as a number, then the core's own check of the value."""

    def parse_text(text: str):
        try:
            value = read(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        try:
            return check(value)
        except ArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None

    return parse_text


def _seconds(text: str) -> float:
    """A gauge's interval: the sampler's rule (check_interval)."""
    from ..readings.sampler import check_interval

    return _core_check(check_interval)(text)


def _window(text: str) -> float:
    """The recorder's window: its rule (check_window)."""
    from ..tracing.recorder import check_window

    return _core_check(check_window)(text)


def _fresh_timeout(text: str) -> float | None:
    """Seconds, or 'none' for no limit (a long training cell): run_fresh's rule (check_timeout)."""
    from ..fresh.run import check_timeout

    if text.strip().lower() == "none":
        return None
    return _core_check(lambda value: check_timeout(value, no_limit="none"), what="seconds or 'none'")(text)


def _search_count(name: str):
    from ..search.batch_search import check_count

    return _core_check(lambda value: check_count(name, value, 1, who=""), read=int, what="a whole number")


def _fraction(text: str) -> float:
    """The search's margin: its rule (check_fraction)."""
    from ..search.batch_search import check_fraction

    return _core_check(lambda value: check_fraction("margin", value, 1, who=""), what="a fraction")(text)


class _Once(argparse.Action):
    """An option given twice is refused, not silently the last one."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_given", set())
        if self.dest in seen:
            parser.error(f"{option_string} given twice: give it once")
        seen.add(self.dest)
        setattr(namespace, self.dest, values)


def _add_setup_arguments(s):
    """The options of %tfmem setup (also those of %%tfmem fresh and batch): the one list of them."""
    for option in SETUP_OPTIONS:
        if option.off_flag:
            switch = s.add_mutually_exclusive_group()
            switch.add_argument(option.flag, action="store_const", const=True, dest=option.name, help=option.help)
            switch.add_argument(option.off_flag, action="store_const", const=False, dest=option.name,
                                help=option.off_help)
        elif option.switch:
            s.add_argument(option.flag, action="store_const", const=True, dest=option.name, help=option.help)
        elif option.choices:
            s.add_argument(option.flag, action=_Once, choices=list(option.choices), dest=option.name,
                           help=option.help)
        else:
            s.add_argument(option.flag, type=_typed(option.parse), action=_Once, metavar=option.metavar,
                           dest=option.name, help=option.help)


def _env_assignment(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def _names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [name for name in names if not name.isidentifier()]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected Python names separated by commas, got {text!r}")
    return names


def _parsers():
    line = MagicArgumentParser(prog="tfmem", description="TensorFlow memory: report (default) or setup.")
    commands = line.add_subparsers(dest="command", metavar="{report,setup,watch,panel,record,oom,plan}")
    commands.add_parser("report", help="one row per device: TensorFlow, the driver (NVML), the host")
    watch = commands.add_parser("watch", help="a live gauge (watch stop: stop every gauge)")
    watch.add_argument("action", nargs="?", choices=["stop"], help="stop every running gauge")
    watch.add_argument("--interval", type=_seconds, action=_Once, default=0.5, metavar="S", help="seconds between readings")
    watch.add_argument("-d", "--device", action=_Once, default=None, help="only this device (e.g. GPU:0)")
    panel = commands.add_parser("panel", help="the device setup panel")
    panel.add_argument("--search", action=_Once, default=None, metavar="NAME",
                       help="a variable holding a batch search: the panel shows what fits at the chosen limit")
    rec = commands.add_parser("record", help="record allocator events (host tracer only) so the next OOM names "
                                             "every chunk's op and layer (record stop: stop)")
    rec.add_argument("action", nargs="?", choices=["stop"], help="stop recording")
    rec.add_argument("--window", type=_window, action=_Once, default=10.0, metavar="S",
                     help="seconds per profiler window (1-3600; default 10)")
    commands.add_parser("oom", help="the last OOM's report again")
    planned = commands.add_parser("plan", help="what a Keras train step needs at a batch, from XLA's plan, before it runs")
    planned.add_argument("model", help="a compiled Keras model (a name or an expression without spaces)")
    planned.add_argument("sample", help="(x, y) of any leading size: only its shapes and types are read")
    planned.add_argument("-b", "--batch", type=_search_count("batch"), action=_Once, required=True, metavar="N",
                         help="the batch to plan")
    planned.add_argument("-v", dest="variable", action=_Once, metavar="NAME", help="store the StepPlan in NAME"
                         )
    s = commands.add_parser(
        "setup",
        help="set TensorFlow's devices up (before its runtime starts), checked against its rules",
        description="Without options and without a GPU: lab mode, 1024 MB.",
    )
    _add_setup_arguments(s)

    cell = MagicArgumentParser(
        prog="%tfmem",
        description="Run the cell and report the exact peak and net change of TensorFlow's allocator.",
    )
    cell.add_argument("mode", nargs="?", choices=["trace"],
                      help="trace: record every allocation of the cell (memory map, OOM dump)")
    cell.add_argument("--keep", action=_Once, metavar="DIR", help="trace: keep the profiler's files in DIR")
    cell.add_argument("--plot", action="store_true", help="trace: draw the memory map and the timeline")
    cell.add_argument("-d", "--device", action=_Once, default=None,
                      help="the device to measure, e.g. GPU:0 or CPU:0 (default: first GPU, else CPU)")
    cell.add_argument("-o", dest="output", action="store_true", help="return the Measurement")
    cell.add_argument("-q", dest="quiet", action="store_true", help="print nothing")
    cell.add_argument("-v", dest="variable", action=_Once, metavar="NAME", help="store the Measurement in NAME")

    fresh = MagicArgumentParser(
        prog="%%tfmem fresh",
        description="Run the cell in a new Python process set up with these options (none: TensorFlow's "
                    "defaults); its output is shown here and the names in -r come back.",
    )
    fresh.add_argument("mode", choices=["fresh"])
    _add_setup_arguments(fresh)
    fresh.add_argument("--env", action="append", type=_env_assignment, default=[], metavar="NAME=VALUE",
                       help="an environment variable for the new process (repeatable)")
    fresh.add_argument("--path", action="append", default=[], metavar="DIR",
                       help="a folder to import from first in the new process (repeatable); the kernel's "
                            "PYTHONPATH is kept, and a PYTHONPATH given with --env adds to it")
    fresh.add_argument("-r", dest="returns", type=_names, action="append", default=[], metavar="NAME,NAME",
                       help="names the cell defines, brought back into this kernel (repeatable)")
    fresh.add_argument("--timeout", type=_fresh_timeout, action=_Once, default=600.0, metavar="S|none",
                       help="stop the process (and what it started) after S seconds (default 600; none: no limit)")
    batch = MagicArgumentParser(
        prog="%%tfmem batch",
        description="The largest batch the cell's build_model() trains with: the cell defines build_model() "
                    "(a compiled Keras model) and make_batch(n) (one batch (x, y) of n examples); each probe "
                    "runs in a new process set up with these options.",
    )
    batch.add_argument("mode", choices=["batch"])
    _add_setup_arguments(batch)
    batch.add_argument("--low", type=_search_count("low"), action=_Once, default=1, metavar="N",
                       help="the smallest batch (default 1)")
    batch.add_argument("--high", type=_search_count("high"), action=_Once, default=65536, metavar="N",
                       help="the largest batch (default 65536)")
    batch.add_argument("--steps", type=_search_count("steps"), action=_Once, default=2, metavar="K",
                       help="train steps a probe runs (default 2)")
    batch.add_argument("--margin", type=_fraction, action=_Once, default=0.0, metavar="F",
                       help="the fraction of the limit the recommended batch leaves free by its measured peaks, "
                            "and of the batch below every failure; probes aimed at it and the batch again "
                            "follow the edge (default 0)")
    batch.add_argument("--timeout", type=_fresh_timeout, action=_Once, default=600.0, metavar="S|none",
                       help="stop a probe (and what it started) after S seconds (default 600)")
    batch.add_argument("--env", action="append", type=_env_assignment, default=[], metavar="NAME=VALUE",
                       help="an environment variable for every probe (repeatable)")
    batch.add_argument("-v", dest="variable", action=_Once, metavar="NAME", help="store the BatchSearch in NAME")
    how = batch.add_mutually_exclusive_group()
    how.add_argument("--plan", action="store_const", const="plan", dest="method",
                     help="plan the step first (XLA's buffer assignment), then confirm with two probes")
    how.add_argument("--probe", action="store_const", const="probe", dest="method", help="probes only")
    return line, cell, fresh, batch


_LINE_PARSER, _CELL_PARSER, _FRESH_PARSER, _BATCH_PARSER = _parsers()


def _parse(parser: MagicArgumentParser, text: str):
    try:
        # Split as a shell would on POSIX: --keep "/a folder" is the folder, without its quotes.
        try:
            argv = arg_split(text, posix=os.name == "posix", strict=True)
        except ValueError as exc:
            raise UsageError(f"cannot split the options ({exc})") from None
        args = parser.parse_args(argv)
        args.__dict__.pop("_given", None)
        return args
    except UsageError as exc:
        magic = {id(_LINE_PARSER): "%tfmem", id(_FRESH_PARSER): "%%tfmem fresh",
                 id(_BATCH_PARSER): "%%tfmem batch"}.get(id(parser), "%%tfmem")
        raise UsageError(f"{magic}: {exc}. See %tfmem? for the options.") from None


@magics_class
class TfmemMagics(Magics):
    @line_cell_magic
    def tfmem(self, line: str, cell: str | None = None):
        if cell is None:
            return self._line(line)
        return self._cell(line, cell)

    def _line(self, line: str):
        args = _parse(_LINE_PARSER, line)
        try:
            if args.command in (None, "report"):
                return report()
            if args.command == "watch":
                return self._watch(args)
            if args.command == "panel":
                from .widgets import SetupPanel

                search = None
                if args.search is not None:
                    if args.search not in self.shell.user_ns:
                        raise ArgumentError(f"%tfmem panel --search: no variable {args.search!r} here; run "
                                            "%%tfmem batch -v NAME (or max_batch_size) first.")
                    search = self.shell.user_ns[args.search]
                return SetupPanel(search=search)
            if args.command == "record":
                from ..tracing import recorder

                if args.action == "stop":
                    stopped = recorder.stop()
                    print("the recorder was not running" if stopped is None else repr(stopped))
                    return None
                return recorder.record(args.window)
            if args.command == "plan":
                return self._plan(args)
            if args.command == "oom":
                from ..oom.explain import last_oom

                found = last_oom()
                if found is None:
                    print("no OOM explained in this process yet")
                return found
            return setup(**{name: getattr(args, name) for name in OPTION_NAMES})
        except TfmemError as exc:  # a bad argument, a rule broken, a runtime started: one line
            raise UsageError(str(exc)) from None

    def _plan(self, args):
        from ..plans.plan import plan

        if args.variable is not None and not args.variable.isidentifier():
            raise ArgumentError(f"%tfmem plan: -v needs a Python name, got {args.variable!r}.")
        values = []
        for what, text in (("model", args.model), ("sample", args.sample)):
            try:
                values.append(self.shell.ev(text))
            except Exception as exc:
                raise ArgumentError(f"%tfmem plan: the {what} {text!r} could not be read here ({type(exc).__name__}: "
                                    f"{exc}).") from None
        result = plan(*values, args.batch)
        if args.variable:
            self.shell.user_ns[args.variable] = result
        return result

    def _watch(self, args):
        from ..tf.devices import resolve_device
        from .widgets.gauge import Gauge, stop_all

        if args.action == "stop":
            print(f"stopped {stop_all()} gauge(s)")
            return None
        device = resolve_device(args.device).name if args.device else None
        return Gauge(interval=args.interval, device=device)

    def _cell(self, line: str, cell: str):
        if line.split(maxsplit=1)[:1] == ["fresh"]:
            return self._fresh(_parse(_FRESH_PARSER, line), cell)
        if line.split(maxsplit=1)[:1] == ["batch"]:
            return self._batch(_parse(_BATCH_PARSER, line), cell)
        args = _parse(_CELL_PARSER, line)
        if args.variable is not None and not args.variable.isidentifier():
            raise UsageError(f"%%tfmem: -v needs a Python name, got {args.variable!r}.")
        if args.mode == "trace":
            return self._trace(args, cell)
        if args.keep or args.plot:
            raise UsageError("%%tfmem: --keep and --plot go with trace (%%tfmem trace --plot).")
        try:
            block = measure(args.device)
            with block as measurement:
                outcome = self.shell.run_cell(cell, store_history=False)
        except TfmemError as exc:
            raise UsageError(str(exc)) from None
        failure = outcome.error_before_exec or outcome.error_in_exec
        if failure is not None:
            measurement.error = type(failure).__name__
        if args.variable:
            self.shell.user_ns[args.variable] = measurement
        if not args.quiet:
            print(repr(measurement))
        return measurement if args.output else None


    def _trace(self, args, cell: str):
        if args.device is not None:
            raise UsageError("%%tfmem trace records every allocator at once: leave out -d.")
        block = trace(keep=args.keep)
        try:
            block.__enter__()
        except TfmemError as exc:  # a trace running already, the profiler held, a folder refused
            raise UsageError(str(exc)) from None
        outcome = None
        try:
            outcome = self.shell.run_cell(cell, store_history=False)
        finally:
            failure = None if outcome is None else (outcome.error_before_exec or outcome.error_in_exec)
            try:
                block.__exit__(type(failure) if failure else None, failure, None)
            except TraceDataError as exc:  # a trace file TensorFlow wrote that cannot be read
                raise UsageError(str(exc)) from None
        result = block.result
        if args.variable:
            self.shell.user_ns[args.variable] = result
        if not args.quiet:
            print(repr(result))
            if result.allocators and getattr(self.shell, "kernel", None) is not None:
                from IPython.display import display

                from .widgets import MapViewer

                display(MapViewer(result))  # in a notebook: the map, its slider, the OOM
            if args.plot and len(result.allocators):
                import matplotlib.pyplot as plt

                result.plot_map()
                result.plot_timeline()
                plt.show()
        return result if args.output else None

    def _fresh(self, args, cell: str):
        from ..fresh.run import run_fresh

        options = {name: getattr(args, name) for name in OPTION_NAMES if getattr(args, name) is not None}
        returns = list(dict.fromkeys(name for names in args.returns for name in names))
        names = [name for name, _ in args.env]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise UsageError(f"%%tfmem fresh: --env {twice[0]} given twice: give it once.")
        try:
            run = run_fresh(cell, setup=options or None, env=dict(args.env), returns=returns,
                            timeout=args.timeout, path=args.path)
        except TfmemError as exc:  # a setup refused, or the fresh process failed
            if getattr(exc, "oom", None) is not None and not exc.oom_shown:
                from IPython.display import display

                display(exc.oom)  # a child killed by its OOM: TensorFlow's dump of it, read here
            raise UsageError(f"%%tfmem fresh: {exc}") from None
        self.shell.user_ns.update(run.values)


    def _batch(self, args, cell: str):
        from ..search.batch_search import max_batch_size

        if args.variable is not None and not args.variable.isidentifier():
            raise UsageError(f"%%tfmem batch: -v needs a Python name, got {args.variable!r}.")
        # The cell's functions are made in a namespace of their own (sent by value to each probe);
        # the kernel's names are readable from it, none is changed.
        namespace = dict(self.shell.user_ns)
        namespace["__name__"] = "__main__"
        try:
            exec(compile(cell, "<%%tfmem batch>", "exec"), namespace)
        except Exception as exc:
            raise UsageError(f"%%tfmem batch: the cell raised {type(exc).__name__}: {exc}") from None
        missing = [name for name in ("build_model", "make_batch") if not callable(namespace.get(name))]
        if missing:
            raise UsageError(f"%%tfmem batch: the cell must define {' and '.join(missing)}(): build_model() returns "
                             "a compiled Keras model, make_batch(n) one batch (x, y) of n examples.")
        options = {name: getattr(args, name) for name in OPTION_NAMES if getattr(args, name) is not None}
        try:
            search = max_batch_size(namespace["build_model"], namespace["make_batch"], setup=options or None,
                                    method=args.method or "auto",
                                    low=args.low, high=args.high, steps=args.steps, margin=args.margin,
                                    probe_timeout=args.timeout, env=dict(args.env))
        except TfmemError as exc:
            raise UsageError(f"%%tfmem batch: {str(exc).removeprefix('max_batch_size: ')}") from None
        if args.variable:
            self.shell.user_ns[args.variable] = search
        return search


def _help() -> str:
    return (
        "TensorFlow memory from a notebook.\n\n"
        "%tfmem                  report: TensorFlow's figures per device, the driver's, the host's\n"
        "%tfmem setup [options]  set devices up before TensorFlow's runtime starts\n"
        "%tfmem watch [--interval S] [-d DEV] | %tfmem watch stop\n"
        "                        a live gauge that moves while cells run\n"
        "%tfmem panel [--search NAME]  the device setup panel (with a batch search: what fits)\n"
        "%tfmem record [--window S] | %tfmem record stop\n"
        "                        record allocator events so the next OOM names each chunk's op and layer\n"
        "%tfmem oom              the last OOM's report (every OOM is explained in its cell)\n"
        "%tfmem plan MODEL SAMPLE -b N [-v NAME]\n"
        "                        what the model's train step needs at batch N, from XLA's plan, before it runs\n"
        "%%tfmem [-d DEV] [-o] [-q] [-v NAME]\n"
        "                        run the cell; exact peak and net change of the allocator\n"
        "%%tfmem trace [--plot] [--keep DIR] [-o] [-q] [-v NAME]\n"
        "                        every allocation of the cell: memory map, peak by op, OOM dump\n"
        "%%tfmem batch [setup options] [--low N] [--high N] [--steps K] [--margin F] [--plan|--probe] [-v NAME]\n"
        "                        the largest batch the cell's build_model() trains with (make_batch(n)),\n"
        "                        each probe in a new process\n"
        "%%tfmem fresh [setup options] [--env NAME=VALUE] [--path DIR] [-r NAME,NAME] [--timeout S]\n"
        "                        run the cell in a new process set up this way; bring NAMEs back\n\n"
        + _LINE_PARSER._subparsers._group_actions[0].choices["setup"].format_help()
        + "\n"
        + _CELL_PARSER.format_help()
        + "\n"
        + _FRESH_PARSER.format_help()
    )


TfmemMagics.tfmem.__doc__ = _help()
