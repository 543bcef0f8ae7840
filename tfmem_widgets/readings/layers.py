"""Memory anatomy: the bytes in use per Keras layer and phase.

Two sources, both exact where they answer:
- the variables of the Keras models and optimizers alive in the user's namespace: each
  variable's buffer address (read through DLPack, no copy) is the address of its chunk, so
  parameters and optimizer state are found chunk for chunk in any map of this process;
- the op that allocated a chunk (a trace or the recorder): Keras names its ops
  ``<model>/<layer>/<op>`` forward, ``gradient_tape/<model>/<layer>/...`` backward and
  ``<optimizer>/...`` for the update; tf.data's ops are the input pipeline.
What neither names is said plainly: ``(activations and temporaries)`` where no op is known,
``(unattributed)`` for chunks with an op that names nothing a user wrote.

An XLA program asks for all its temporaries as one buffer, with no op: a plan of the same program
(``plan()``, plans/plan.py) knows that buffer's size to the byte and which Keras layer and phase each
of its pieces serves at the program's peak. A chunk an XLA program asked for with exactly that size
is split the same way (``remember_program``): its live pieces by layer and phase, the rest of its
request not live at that peak, and the chunk's bytes beyond the request (the allocator's no-split rule
hands out a whole free chunk) each said as such.
"""

from __future__ import annotations

import ctypes
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field

from ..frontend import frontend
from ..text import marked
from ..tf.messages import FUNCTION
from ..units import format_bytes

PARAMETERS = "parameters"
OPTIMIZER_STATE = "optimizer state"
FORWARD = "forward activations"
BACKWARD = "backward (gradients, temporaries)"
UPDATE = "optimizer update"
OTHER = "other"
PHASES = (PARAMETERS, OPTIMIZER_STATE, FORWARD, BACKWARD, UPDATE, OTHER)

ACTIVATIONS = "(activations and temporaries)"  # in use, no op known (no trace), Keras models about
NO_OP_KNOWN = "(tensors, no op known)"  # the same without a Keras model in sight
INPUT_PIPELINE = "(input pipeline)"
LOSS = "(loss and metrics)"
UNATTRIBUTED = "(unattributed)"
BEFORE_TRACE = "(before the trace)"


@dataclass(frozen=True)
class KnownVariable:
    """A Keras variable whose chunk is known by address."""

    address: int
    nbytes: int
    path: str  # Keras' path, e.g. 'sequential/wide/kernel'
    layer: str  # the layer's path, e.g. 'sequential/wide'; an optimizer's own for its counters
    phase: str  # PARAMETERS or OPTIMIZER_STATE


# -- the user's Keras objects ----------------------------------------------------------------

def _keras_objects(namespace: dict):
    """Keras models and optimizers among the namespace's values (one level into lists,
    tuples and dicts); nothing when Keras was never imported."""
    keras = sys.modules.get("keras")
    if keras is None:
        return [], []
    model_type = getattr(keras, "Model", None)
    optimizer_type = getattr(getattr(keras, "optimizers", None), "Optimizer", None)
    models, optimizers = {}, {}
    values = []
    for name, value in list(namespace.items()):
        if name.startswith("_"):
            continue
        values.append(value)
        if isinstance(value, (list, tuple)):
            values.extend(value[:100])
        elif isinstance(value, dict):
            values.extend(list(value.values())[:100])
    for value in values:
        try:
            if model_type is not None and isinstance(value, model_type):
                models[id(value)] = value
                opt = getattr(value, "optimizer", None)
                if optimizer_type is not None and isinstance(opt, optimizer_type):
                    optimizers[id(opt)] = opt
            elif optimizer_type is not None and isinstance(value, optimizer_type):
                optimizers[id(value)] = value
        except Exception:  # a proxy object whose isinstance misbehaves: not ours to judge
            continue
    return list(models.values()), list(optimizers.values())


def tensor_address(tensor) -> int | None:
    """The address of an eager tensor's buffer (DLPack shares it, copies nothing); None when
    TensorFlow cannot export it (a dtype DLPack lacks)."""
    import tensorflow as tf

    try:
        capsule = tf.experimental.dlpack.to_dlpack(tensor)
    except Exception:
        return None
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    pointer = get(capsule, b"dltensor")
    # DLManagedTensor starts with DLTensor, whose first field is the data pointer.
    return ctypes.cast(pointer, ctypes.POINTER(ctypes.c_void_p))[0] or None


def _variable_address(variable) -> int | None:
    import tensorflow as tf

    try:
        value = tf.convert_to_tensor(variable)  # a read: in eager it shares the variable's buffer
    except Exception:  # uninitialized (a first step that failed), or not readable
        return None
    return tensor_address(value)


def _addresses(variable) -> list[int]:
    """The addresses of a variable's buffers: one, or under a tf.distribute strategy one per replica (a
    MirroredVariable holds a copy on each replica's device; on logical CPUs in lab mode the copies share one
    buffer until the first write, which then counts once)."""
    import tensorflow as tf

    inner = getattr(variable, "value", None)  # (a Keras variable's TensorFlow variable)
    copies = list(inner.values) if isinstance(inner, tf.distribute.DistributedValues) else [variable]
    found = [_variable_address(copy) for copy in copies]
    return list(dict.fromkeys(a for a in found if a is not None))


def _nbytes(variable) -> int:
    shape = [int(d) for d in variable.shape]
    count = 1
    for d in shape:
        count *= d
    import numpy as np

    return count * np.dtype(str(variable.dtype).replace("bfloat16", "float16")).itemsize


def keras_variables(namespace: dict | None = None) -> list[KnownVariable]:
    """Every variable of the Keras models and optimizers in the namespace, with its buffer's
    address (one per buffer)."""
    if "tensorflow" not in sys.modules:
        return []
    models, optimizers = _keras_objects(frontend().user_namespace() if namespace is None else namespace)
    found: list[KnownVariable] = []
    model_paths: dict[str, str] = {}  # 'sequential_wide_kernel' -> 'sequential/wide'
    seen: set[int] = set()
    for model in models:
        for variable in model.variables:
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            path = str(getattr(variable, "path", variable.name))
            layer = path.rsplit("/", 1)[0] if "/" in path else path
            model_paths[path.replace("/", "_")] = layer
            found += [KnownVariable(address, _nbytes(variable), path, layer, PARAMETERS) for address in _addresses(variable)]
    for optimizer in optimizers:
        own = str(getattr(optimizer, "name", "optimizer"))
        for variable in optimizer.variables:
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            name = str(variable.name)
            # Keras names a slot '<variable path with _>_<slot>': the longest match is its owner.
            owner = max((k for k in model_paths if name.startswith(k + "_")), key=len, default=None)
            layer = model_paths[owner] if owner else f"({own})"
            path = str(getattr(variable, "path", name))
            found += [KnownVariable(address, _nbytes(variable), path, layer, OPTIMIZER_STATE)
                      for address in _addresses(variable)]
    # Variables assigned one value share its buffer until one is written (copy on write: an
    # optimizer's zero slots before its first update). One owner and phase: the chunk is theirs;
    # claimants that disagree leave it unnamed.
    claims = defaultdict(list)
    for v in found:
        claims[v.address].append(v)
    return [vs[0] for vs in claims.values() if len({(v.layer, v.phase) for v in vs}) == 1]


def keras_layers(namespace: dict | None = None) -> list[str]:
    """The layer paths of the Keras models in the namespace ('sequential/wide', ...)."""
    if "keras" not in sys.modules:
        return []
    models, _ = _keras_objects(frontend().user_namespace() if namespace is None else namespace)
    paths = []
    for model in models:
        try:
            layers = model._flatten_layers(include_self=False, recursive=True)
        except Exception:
            layers = getattr(model, "layers", [])
        for layer in layers:
            path = getattr(layer, "path", None) or f"{model.name}/{layer.name}"
            paths.append(str(path))
    return paths


def optimizer_names(namespace: dict | None = None) -> list[str]:
    if "keras" not in sys.modules:
        return []
    _, optimizers = _keras_objects(frontend().user_namespace() if namespace is None else namespace)
    return [str(getattr(o, "name", "")) for o in optimizers if getattr(o, "name", "")]


# -- XLA programs planned in this process ---------------------------------------------------

XLA_PROGRAM = "(XLA program"  # the start of the name the trace's reader gives an XLA program's allocations
_PROGRAMS: dict[int, dict[str, dict[str, int]]] = {}  # a planned temporary buffer's bytes -> its live pieces
_PROGRAMS_KEPT = 64


def remember_program(request_bytes: int, rows: dict[str, dict[str, int]]) -> None:
    """A plan's temporary buffer of `request_bytes` and its pieces live at the program's peak, by key
    and phase: a traced chunk an XLA program asked for with that size is read as this buffer."""
    _PROGRAMS.pop(int(request_bytes), None)
    _PROGRAMS[int(request_bytes)] = {k: dict(v) for k, v in rows.items()}
    while len(_PROGRAMS) > _PROGRAMS_KEPT:
        _PROGRAMS.pop(next(iter(_PROGRAMS)))


def known_program(request_bytes: int | None) -> dict[str, dict[str, int]] | None:
    return None if request_bytes is None else _PROGRAMS.get(int(request_bytes))


def planned_program_sizes() -> list[int]:
    """The sizes of the buffers of temporaries planned in this process."""
    return list(_PROGRAMS)


COMPILE_SCRATCH = ": scratch while compiling, before its first run)"


def name_compile_scratch(events) -> bool:
    """An XLA program's allocations before its first run are its compilation's: XLA's GPU autotuner
    tries kernels with buffers from the same allocator, named like the program's own. Where a planned
    buffer of temporaries shows a program's first run, each allocation it made and gave back before is
    renamed so. Returns whether any was."""
    import numpy as np

    sizes = planned_program_sizes()
    if not sizes or not len(events):
        return False
    renamed = False
    allocations = events.kind == 1
    planned = allocations & np.isin(events.requested, sizes)
    for index, text in enumerate(list(events.texts)):
        if not text.startswith(XLA_PROGRAM) or text.endswith(COMPILE_SCRATCH):
            continue
        mine = events.op == index
        runs = np.nonzero(mine & planned)[0]
        if not len(runs):
            continue
        first = int(runs[0])
        # Scratch is given back before the program runs; what is still held then (an output made ahead
        # of the temporaries) keeps the program's name. At one address allocations and frees alternate:
        # an allocation was given back before the run where the next event at its address is a free.
        order = np.lexsort((np.arange(first), events.address[:first]))
        address, kind = events.address[:first][order], events.kind[:first][order]
        freed = np.zeros(first, dtype=bool)
        freed[order[:-1]] = (address[1:] == address[:-1]) & (kind[1:] < 0)
        before = np.nonzero(mine[:first] & allocations[:first] & freed)[0]
        if len(before):
            events.texts.append(text[:-1] + COMPILE_SCRATCH)
            events.op[before] = len(events.texts) - 1
            renamed = True
    return renamed


def _split_program(chunk, pieces: dict[str, dict[str, int]], rows) -> None:
    """A traced XLA buffer read by its plan: live pieces by key and phase, the rest said as such."""
    live = 0
    for key, phases in pieces.items():
        for phase, size in phases.items():
            rows[key][phase] += size
            live += size
    program = chunk.op.rstrip(")")
    if chunk.requested > live:
        rows[f"{program}: temporaries not live at its peak)"][OTHER] += chunk.requested - live
    if chunk.size > chunk.requested:
        rows[f"{program}: its chunk beyond the request)"][OTHER] += chunk.size - chunk.requested


# -- an op's name, read the way Keras writes it ----------------------------------------------

_WRAPPERS = {"StatefulPartitionedCall", "PartitionedCall", "while", "cond", "body"}
# tf.data's ops, and the copy of a batch onto a GPU (SameWorkerRecvDone)
_PIPELINE = re.compile(r"Dataset|Iterator|GatherV2|IteratorGetNext|OptionalFromValue|OptionalGetValue|RecvDone|_Recv")
_SUFFIX = re.compile(r"(?:_\d+)+$")
_REPLICA = re.compile(r"replica_\d+")  # a tf.distribute strategy's scope of each replica's ops past the first


class OpReader:
    """Reads an op name into (key, phase) given the layers and optimizers Keras knows of."""

    def __init__(self, layers=(), optimizers=()):
        self.layers = {tuple(p.split("/")): p for p in layers}
        self.optimizers = {o.lower() for o in optimizers} | {"adam", "adamw", "sgd", "rmsprop", "adagrad",
                                                              "adadelta", "adamax", "nadam", "ftrl", "lion"}
        self.models = {p[0] for p in self.layers}

    def read(self, op: str) -> tuple[str, str]:
        if op.startswith("("):  # no op: the activity that made it, named by the trace's reader
            return op, OTHER
        parts = [p for p in op.split("/") if p]
        function = next((FUNCTION.search(p).group(1) for p in parts if FUNCTION.search(p)), None)
        backward = False
        while parts and (parts[0] in _WRAPPERS or parts[0].startswith("__inference")
                         or parts[0] == "gradient_tape" or _REPLICA.fullmatch(parts[0])):
            backward |= parts[0] == "gradient_tape"
            parts = parts[1:]
        if not parts:
            return (f"(in {function})", OTHER) if function else (UNATTRIBUTED, OTHER)
        layer = self._layer(parts)
        if layer is not None:
            return layer, BACKWARD if backward else FORWARD
        head = _SUFFIX.sub("", parts[0]).lower()
        if head in self.optimizers:
            return f"({parts[0] if head == parts[0].lower() else head})", UPDATE
        if _PIPELINE.search(op):
            return INPUT_PIPELINE, OTHER
        if head.startswith(("compile_loss", "compile_metrics", "loss", "metrics", "mean", "mean_squared")):
            return LOSS, BACKWARD if backward else OTHER
        return f"(op {parts[0]})", BACKWARD if backward else OTHER  # an op outside any layer: named as it is

    def _layer(self, parts: list[str]) -> str | None:
        """The longest known layer path the op's scopes name. A scope is a layer's name, or the
        name with the suffix TensorFlow added when the scope was entered again; the model's own
        suffix is tried first (the layers of one call share it)."""
        if not self.layers:
            return None
        best = None
        model_suffix = None
        for model in self.models:
            if parts[0] == model:
                model_suffix = ""
            elif parts[0].startswith(model + "_") and _SUFFIX.fullmatch(parts[0][len(model):]):
                model_suffix = parts[0][len(model):]
            else:
                continue
            prefix = (model,)
            for depth in range(1, len(parts)):
                component = parts[depth]
                candidates = [p for p in self.layers if len(p) == len(prefix) + 1 and p[:len(prefix)] == prefix]
                match = None
                for path in candidates:  # the model's suffix first, then exact, then any suffix
                    if model_suffix and component == path[-1] + model_suffix:
                        match = path
                        break
                if match is None:
                    match = next((p for p in candidates if component == p[-1]), None)
                if match is None:
                    stripped = [p for p in candidates if component.startswith(p[-1] + "_")
                                and _SUFFIX.fullmatch(component[len(p[-1]):])]
                    match = max(stripped, key=lambda p: len(p[-1]), default=None)
                if match is None:
                    break
                prefix = match
                best = self.layers[match]
        return best


# -- the anatomy ---------------------------------------------------------------------------

@dataclass
class LayerAnatomy:
    """Bytes in use per key (a Keras layer's path, or a parenthesized key for what has no
    layer) and phase. Iterates the largest first, whatever the key."""

    rows: dict[str, dict[str, int]]
    total_bytes: int
    notes: tuple[str, ...] = field(default=())

    def totals(self) -> dict[str, int]:
        return {k: sum(v.values()) for k, v in self.rows.items()}

    def _order(self) -> list[str]:
        totals = self.totals()
        return sorted(totals, key=lambda k: (-totals[k], k))

    def __iter__(self):
        return iter(self._order())

    def keys(self):
        return self._order()

    def items(self):
        totals = self.totals()
        return [(k, totals[k]) for k in self._order()]

    def __getitem__(self, key: str) -> int:
        return self.totals()[key]

    def __contains__(self, key) -> bool:
        return key in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def phases(self, key: str) -> dict[str, int]:
        return dict(self.rows[key])

    @property
    def layers(self) -> list[str]:
        return [k for k in self._order() if not k.startswith("(")]

    @property
    def unattributed_bytes(self) -> int:
        return sum(self.rows.get(UNATTRIBUTED, {}).values())

    def lines(self, top: int = 12, varies: tuple[str, ...] = ()) -> list[str]:
        """The rows, largest first. varies: keys whose bytes vary (an OOM of a compiled step on a CPU: the bytes no
        op names hold the kernels' temporaries): their totals are marked " (this CPU)", one space after the key's
        column, not padded to the figures' column."""
        order = self._order()
        width = max([len(k) for k in order[:top]] + [5])
        out = []
        for key in order[:top]:
            shown = {p: b for p, b in self.rows[key].items() if b}
            if set(shown) == {OTHER} or shown.get(OTHER, 0) < self[key] / 100:
                shown.pop(OTHER, None)  # all of the row (its total says it), or too little to name
            phases = ", ".join(f"{p} {format_bytes(b)}" for p, b in sorted(  # (other too: a mixed policy's casts)
                shown.items(), key=lambda pb: PHASES.index(pb[0]) if pb[0] in PHASES else 99))
            total = marked(format_bytes(self[key]), True) if key in varies else f"{format_bytes(self[key]):>11}"
            out.append(f"  {key:<{width}} {total}  {phases}")
        if len(order) > top:
            rest = sum(self[k] for k in order[top:])
            out.append(f"  ... {len(order) - top} more: {marked(format_bytes(rest), bool(set(order[top:]) & set(varies)))}")
        return out

    def __repr__(self) -> str:
        head = f"by layer: {format_bytes(self.total_bytes)} in use"
        return "\n".join([head, *self.lines(top=50), *[f"  note: {n}" for n in self.notes]])

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))


def anatomy(amap, namespace: dict | None = None, variables=None, reader: OpReader | None = None,
            live: bool = True) -> LayerAnatomy:
    """The in-use chunks of `amap` by layer and phase.

    live: the map is of this process's allocator as it is now or was at an OOM in the
    current state of the namespace, so the variables' addresses apply; a map from another
    process or file is read from its op names alone.
    """
    if variables is None:
        variables = keras_variables(namespace) if live else []
    if reader is None:
        reader = OpReader(keras_layers(namespace), optimizer_names(namespace))
    by_address = {v.address: v for v in variables}
    rows: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    notes = []
    matched = 0
    unnamed = 0
    for chunk in amap.chunks:
        if not chunk.in_use:
            continue
        known = by_address.get(chunk.address)
        # a chunk of a past moment (a trace's peak) may sit where a variable lives now: it is the
        # variable's only if it asked for the variable's bytes
        if known is not None and chunk.size >= known.nbytes and chunk.requested in (None, known.nbytes):
            rows[known.layer][known.phase] += chunk.size
            matched += 1
            continue
        pieces = known_program(chunk.requested) if chunk.op.startswith(XLA_PROGRAM) else None
        if pieces is not None and chunk.requested <= chunk.size:
            _split_program(chunk, pieces, rows)
        elif chunk.op:
            key, phase = reader.read(chunk.op)
            rows[key][phase] += chunk.size
        else:
            unnamed += chunk.size
    if amap.before_trace_bytes:
        rows[BEFORE_TRACE][OTHER] += amap.before_trace_bytes
    if unnamed:
        if amap.source == "trace" or any(c.op for c in amap.chunks):
            rows[UNATTRIBUTED][OTHER] += unnamed
        else:
            rows[ACTIVATIONS if variables else NO_OP_KNOWN][OTHER] += unnamed
            notes.append("TensorFlow's dump names no ops" + (": chunks that are not a Keras variable are counted as "
                         "activations and temporaries" if variables else "") +
                         "; %tfmem record (or %%tfmem trace) names each chunk's op and layer")
    if variables and not matched and live and not amap.before_trace_bytes:
        notes.append("no Keras variable of the namespace is in this map (another device, or freed)")
    plain = {k: dict(v) for k, v in rows.items()}
    return LayerAnatomy(plain, amap.in_use_bytes, tuple(notes))
