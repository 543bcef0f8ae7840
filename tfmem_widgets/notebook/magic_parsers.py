"""The language of %tfmem and %%tfmem: one argparse parser per subcommand, the help built from them.

A line runs a subcommand (``%tfmem`` alone: report); a cell runs under a mode (``%%tfmem`` alone:
measure). Every subcommand that makes a result takes -o, -q and -v NAME as IPython's %timeit does
(add_result_flags); each checks its values with the core's own rules, so a bad one is one line.
"""

from __future__ import annotations

import argparse
import keyword
import os
import textwrap

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicArgumentParser, MagicHelpFormatter
from IPython.utils.process import arg_split

from ..errors import ArgumentError
from ..tf.options import SETUP_OPTIONS


class _Formatter(MagicHelpFormatter):
    """IPython's magic help format, at one width in every terminal (the help reads the same everywhere)."""

    def __init__(self, prog: str):
        super().__init__(prog, width=100, max_help_position=30)


def _description(summary: str, more: str) -> str:
    """A parser's description: its one-line summary (its line in %tfmem?), then what its own help adds."""
    return summary + (f"\n\n{textwrap.fill(more, 100)}" if more else "")


def summary_of(parser: argparse.ArgumentParser) -> str:
    return parser.description.split("\n\n")[0]


def _parser(prog: str, summary: str, more: str = "") -> MagicArgumentParser:
    parser = MagicArgumentParser(prog=prog, description=_description(summary, more), formatter_class=_Formatter)
    _add_help(parser)
    return parser


class _HelpAsked(Exception):
    """-h was given: `parser` is the one whose help it asks for."""

    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


class _Help(argparse.Action):
    """-h: the parser's help instead of the work (argparse's own -h would exit the kernel)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        raise _HelpAsked(parser)


def _add_help(parser) -> None:
    parser.add_argument("-h", "--help", action=_Help, help="show these options and do nothing else")


class _Once(argparse.Action):
    """An option given twice is refused, not silently the last one."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_given", set())
        if self.dest in seen:
            parser.error(f"{option_string} given twice: give it once")
        seen.add(self.dest)
        setattr(namespace, self.dest, values)


# -- argparse types: the text read, then the core's own rule for the value ----------------------
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


def _python_name(text: str) -> str:
    if not text.isidentifier() or keyword.iskeyword(text):
        raise argparse.ArgumentTypeError(f"expected a Python name to store the result in, got {text!r}")
    return text


# -- the options parsers share -----------------------------------------------------------------
def add_result_flags(parser, result: str) -> None:
    """-o, -q and -v NAME, as IPython's %timeit takes them: the one place they are declared and checked."""
    parser.add_argument("-o", dest="output", action="store_true", help=f"return the {result} (the cell's Out)")
    parser.add_argument("-q", dest="quiet", action="store_true", help=f"do not show the {result} (it is still made)")
    parser.add_argument("-v", dest="variable", type=_python_name, action=_Once, metavar="NAME",
                        help=f"store the {result} in the variable NAME")


def add_setup_arguments(parser) -> None:
    """The options of %tfmem setup (also those of %%tfmem fresh and batch): the one list of them."""
    for option in SETUP_OPTIONS:
        if option.off_flag:
            switch = parser.add_mutually_exclusive_group()
            switch.add_argument(option.flag, action="store_const", const=True, dest=option.name, help=option.help)
            switch.add_argument(option.off_flag, action="store_const", const=False, dest=option.name,
                                help=option.off_help)
        elif option.switch:
            parser.add_argument(option.flag, action="store_const", const=True, dest=option.name, help=option.help)
        elif option.choices:
            parser.add_argument(option.flag, action=_Once, choices=list(option.choices), dest=option.name,
                                help=option.help)
        else:
            parser.add_argument(option.flag, type=_typed(option.parse), action=_Once, metavar=option.metavar,
                                dest=option.name, help=option.help)


def _add_env(parser, whose: str) -> None:
    parser.add_argument("--env", action="append", type=_env_assignment, default=[], metavar="NAME=VALUE",
                        help=f"an environment variable for {whose} (repeatable)")


# -- %tfmem: a subcommand per line ---------------------------------------------------------------
def _subcommand(commands, name: str, summary: str, more: str = "") -> MagicArgumentParser:
    """A subcommand: `summary` is its line in %tfmem?, `more` what its own help adds."""
    parser = commands.add_parser(name, help=summary, description=_description(summary, more),
                                 formatter_class=_Formatter)
    _add_help(parser)
    return parser


def _reading_commands(commands) -> None:
    add_result_flags(_subcommand(commands, "report", "One row per device: TensorFlow's figures, the driver's "
                                 "(NVML), the host's.", "%tfmem alone is %tfmem report."), "MemoryReport")
    setup = _subcommand(commands, "setup", "Set TensorFlow's devices up before its runtime starts, checked against "
                        "its rules.", "Without options and without a GPU: lab mode, 1024 MB.")
    add_setup_arguments(setup)
    add_result_flags(setup, "SetupResult")
    watch = _subcommand(commands, "watch", "A live gauge that moves while cells run; watch stop stops every gauge.",
                        "Returns the gauge (a widget).")
    watch.add_argument("action", nargs="?", choices=["stop"], help="stop every running gauge")
    watch.add_argument("--interval", type=_seconds, action=_Once, default=0.5, metavar="S",
                       help="seconds between readings")
    watch.add_argument("-d", "--device", action=_Once, default=None, help="only this device (e.g. GPU:0)")
    panel = _subcommand(commands, "panel", "The device setup panel.", "Returns the panel (a widget).")
    panel.add_argument("--search", action=_Once, default=None, metavar="NAME",
                       help="a variable holding a batch search: the panel shows what fits at the chosen limit")


def _oom_commands(commands) -> None:
    record = _subcommand(commands, "record", "Record allocator events so the next OOM names each chunk's op and "
                         "layer; record stop stops.", "The host tracer only. Returns the recorder.")
    record.add_argument("action", nargs="?", choices=["stop"], help="stop recording")
    record.add_argument("--window", type=_window, action=_Once, default=10.0, metavar="S",
                        help="seconds per profiler window (1-3600; default 10)")
    add_result_flags(_subcommand(commands, "oom", "The last OOM's report again (every OOM is explained in its "
                                 "cell).", "-v NAME stores None where there was none."), "OomReport")
    planned = _subcommand(commands, "plan", "What a Keras train step needs at a batch, from XLA's plan, before it "
                          "runs.")
    planned.add_argument("model", help="a compiled Keras model (a name or an expression without spaces)")
    planned.add_argument("sample", nargs="+", help="(x, y) of any leading size (an expression, spaces and all): only "
                         "its shapes and types are read")
    planned.add_argument("-b", "--batch", type=_search_count("batch"), action=_Once, required=True, metavar="N",
                         help="the batch to plan")
    add_result_flags(planned, "StepPlan")
    guarded = _subcommand(commands, "guard", "Plan each Keras fit at its batch before its first step; stop one "
                          "that cannot fit or would abort, with the batch that fits.",
                          "One plan per model, batch and shapes; guard off turns it off.")
    guarded.add_argument("action", nargs="?", choices=["on", "off"], default="on", help="on (the default) or off")
    _subcommand(commands, "died", "How the kernels before this one in this folder died, explained (the first "
                "%load_ext after a death tells it once).")


def _line_parser() -> tuple[MagicArgumentParser, dict[str, MagicArgumentParser]]:
    line = _parser("tfmem", "TensorFlow's memory from a notebook: %tfmem SUBCOMMAND (alone: report).")
    commands = line.add_subparsers(dest="command", title="subcommands")
    _reading_commands(commands)
    _oom_commands(commands)
    return line, dict(commands.choices)


# -- %%tfmem: a mode per cell --------------------------------------------------------------------
def _measure_parser() -> MagicArgumentParser:
    cell = _parser("%tfmem", "Run the cell; the exact peak and net change of TensorFlow's allocator.")
    cell.add_argument("-d", "--device", action=_Once, default=None,
                      help="the device to measure, e.g. GPU:0 or CPU:0 (default: first GPU, else CPU)")
    add_result_flags(cell, "Measurement")
    return cell


def _trace_parser() -> MagicArgumentParser:
    traced = _parser("%tfmem trace", "Run the cell and record every allocation: its memory map, peak by op, an "
                     "OOM's dump.", "Every allocator at once, from TensorFlow's profiler.")
    traced.add_argument("--keep", action=_Once, metavar="DIR", help="keep the profiler's files in DIR")
    traced.add_argument("--plot", action="store_true", help="draw the memory map and the timeline")
    add_result_flags(traced, "Trace")
    return traced


def _fresh_parser() -> MagicArgumentParser:
    fresh = _parser("%tfmem fresh", "Run the cell in a new Python process set up with these options.",
                    "No options: TensorFlow's defaults. Its output is shown here and the names in -r come back.")
    add_setup_arguments(fresh)
    _add_env(fresh, "the new process")
    fresh.add_argument("--path", action="append", default=[], metavar="DIR",
                       help="a folder to import from first in the new process (repeatable); the kernel's "
                            "PYTHONPATH is kept, and a PYTHONPATH given with --env adds to it")
    fresh.add_argument("-r", dest="returns", type=_names, action="append", default=[], metavar="NAME,NAME",
                       help="names the cell defines, brought back into this kernel (repeatable)")
    fresh.add_argument("--timeout", type=_fresh_timeout, action=_Once, default=600.0, metavar="S|none",
                       help="stop the process (and what it started) after S seconds (default 600; none: no limit)")
    add_result_flags(fresh, "FreshRun")
    return fresh


def _batch_parser() -> MagicArgumentParser:
    batch = _parser("%tfmem batch", "The largest batch the cell's build_model() trains with, each probe in a new "
                    "process.", "The cell defines build_model() (a compiled Keras model) and make_batch(n) (one "
                    "batch (x, y) of n examples); each probe's process is set up with these options.")
    add_setup_arguments(batch)
    for name, default, metavar, what in (("low", 1, "N", "the smallest batch"), ("high", 65536, "N", "the largest batch"),
                                         ("steps", 2, "K", "train steps a probe runs")):
        batch.add_argument(f"--{name}", type=_search_count(name), action=_Once, default=default, metavar=metavar,
                           help=f"{what} (default {default})")
    batch.add_argument("--margin", type=_fraction, action=_Once, default=0.0, metavar="F",
                       help="the fraction of the limit the recommended batch leaves free by its measured peaks, "
                            "and of the batch below every failure; probes aimed at it and the batch again "
                            "follow the edge (default 0)")
    batch.add_argument("--timeout", type=_fresh_timeout, action=_Once, default=600.0, metavar="S|none",
                       help="stop a probe (and what it started) after S seconds (default 600)")
    _add_env(batch, "every probe")
    how = batch.add_mutually_exclusive_group()
    how.add_argument("--plan", action="store_const", const="plan", dest="method",
                     help="plan the step first (XLA's buffer assignment), then confirm with two probes")
    how.add_argument("--probe", action="store_const", const="probe", dest="method", help="probes only")
    add_result_flags(batch, "BatchSearch")
    return batch


LINE, SUBCOMMANDS = _line_parser()
# The cell's modes: the first word of the line, none for measure.
CELL_MODES = {"measure": _measure_parser(), "trace": _trace_parser(), "fresh": _fresh_parser(),
              "batch": _batch_parser()}

# An option given to the mode it does not belong to: what was meant.
_MISPLACED = {
    ("measure", "--keep"): "--keep and --plot go with trace (%%tfmem trace --plot)",
    ("measure", "--plot"): "--keep and --plot go with trace (%%tfmem trace --plot)",
    ("trace", "-d"): "a trace records every allocator at once: leave out -d",
    ("trace", "--device"): "a trace records every allocator at once: leave out --device",
}


def _split(text: str) -> list[str]:
    # Split as a shell would on POSIX: --keep "/a folder" is the folder, without its quotes.
    try:
        return arg_split(text, posix=os.name == "posix", strict=True)
    except ValueError as exc:
        raise UsageError(f"cannot split the options ({exc})") from None


def magic_name(name: str, cell: bool) -> str:
    """A subcommand or mode as the user writes it: %tfmem setup, %%tfmem, %%tfmem trace."""
    if not cell:
        return f"%tfmem {name}"
    return "%%tfmem" if name == "measure" else f"%%tfmem {name}"


def _parsed(parser: MagicArgumentParser, argv: list[str], magic: str):
    """The arguments, or None where -h printed the help asked for; a refusal is one UsageError line."""
    try:
        args = parser.parse_args(argv)
    except _HelpAsked as asked:
        print(help_text() if asked.parser is LINE else asked.parser.format_help())
        return None
    except UsageError as exc:
        raise UsageError(f"{magic}: {exc}. See {magic} -h for its options.") from None
    args.__dict__.pop("_given", None)
    return args


def parse_line(text: str):
    """%tfmem's line as (subcommand, arguments); None where -h printed a help."""
    try:
        argv = _split(text)
    except UsageError as exc:
        raise UsageError(f"%tfmem: {exc}.") from None
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["report", *argv]  # %tfmem [options] is %tfmem report [options]
    magic = magic_name(argv[0], cell=False) if argv[0] in SUBCOMMANDS else "%tfmem"
    args = _parsed(LINE, argv, magic)
    return None if args is None else (args.command, args)


def parse_cell(text: str):
    """%%tfmem's line as (mode, arguments); None where -h printed a help."""
    try:
        argv = _split(text)
    except UsageError as exc:
        raise UsageError(f"%%tfmem: {exc}.") from None
    mode = argv[0] if argv and argv[0] in CELL_MODES and argv[0] != "measure" else "measure"
    options = argv[1:] if mode != "measure" else argv
    magic = magic_name(mode, cell=True)
    for word in options:
        if (mode, word) in _MISPLACED:
            raise UsageError(f"{magic}: {_MISPLACED[mode, word]}.")
    args = _parsed(CELL_MODES[mode], options, magic)
    return None if args is None else (mode, args)


def _usage(parser: MagicArgumentParser) -> str:
    return parser.format_usage().rstrip()


def help_text() -> str:
    """%tfmem?: every subcommand's and mode's usage and first line, as argparse formats them."""
    parts = [
        "TensorFlow's memory from a notebook. A line runs a subcommand (%tfmem alone: report); a cell runs\n"
        "under a mode (%%tfmem alone: measure). A subcommand that makes a result takes -o (return it: the\n"
        "cell's Out), -q (do not show it) and -v NAME (store it in NAME), as %timeit does; unless -q, it\n"
        "is shown. SUBCOMMAND -h (or MODE -h) gives its options, e.g. %tfmem setup -h.",
        "",
        "Line magic:",
        "",
    ]
    for parser in (*SUBCOMMANDS.values(), "Cell magic:", *CELL_MODES.values()):
        parts += [parser, ""] if isinstance(parser, str) else [_usage(parser), "", summary_of(parser), ""]
    return "\n".join(parts)
