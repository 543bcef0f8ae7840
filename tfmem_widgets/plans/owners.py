"""Whose bytes a planned step holds: each of XLA's buffers read back to a Keras layer and a phase.

An instruction carries the TensorFlow op it came from: ``<model>/<layer>/MatMul`` forward,
``gradient_tape/<model>/<layer>/...`` backward, ``<optimizer>/...`` the update. TensorFlow makes
graph scopes unique (layer ``dense`` of model ``sequential`` can be ``sequential_1/dense_1``), so
the scopes are recorded as Keras enters them while the step is traced, with the object that entered
each. Instructions XLA made itself (copies, iotas, some rewritten convolutions) carry no op: they
are named by the nearest consumer that has one, and an optimizer's buffer by the variable its
update writes.
"""

from __future__ import annotations

from ..readings.layers import BACKWARD, FORWARD, LOSS, OTHER, UNATTRIBUTED, UPDATE

BATCH = "(batch)"


class ScopeRecorder:
    """While a step is traced: graph name scope -> (what entered it, its Keras path). Keras enters
    every scope through its TensorFlow backend's ``name_scope(name, caller=obj)``; its ``__enter__``
    is wrapped for the trace only."""

    def __init__(self):
        self.scopes: dict[str, tuple[str, str]] = {}

    def __enter__(self):
        import keras
        import tensorflow as tf
        from keras.src.backend.common.name_scope import current_path
        from keras.src.backend.tensorflow import core

        self._class, self._enter = core.name_scope, core.name_scope.__enter__
        scopes, enter = self.scopes, self._enter

        def kind(caller) -> str:
            for name, cls in (("optimizer", keras.optimizers.Optimizer), ("metric", keras.metrics.Metric),
                              ("loss", keras.losses.Loss), ("layer", keras.layers.Layer)):
                if isinstance(caller, cls):
                    return name
            return "other"

        def recording_enter(scope):
            entered = enter(scope)
            if scope._pop_on_exit:
                path = current_path()
                what = kind(scope.caller) if scope.caller is not None else (
                    "loss" if path.split("/")[0] == "compile_loss" else "other")
                scopes.setdefault(tf.compat.v1.get_default_graph().get_name_scope(), (what, path))
            return entered

        self._class.__enter__ = recording_enter
        return self

    def __exit__(self, *exc) -> bool:
        self._class.__enter__ = self._enter
        return False


def parameter_owners(model, concrete, batch_count: int) -> dict[int, str | None]:
    """XLA's entry parameter number -> the Keras layer path of its variable, or BATCH. The entry
    parameters are the function's flat inputs, then its captured inputs in order, each the very
    handle of a variable; an optimizer's slot belongs to the variable its path names."""
    owners: dict[int, str | None] = {k: BATCH for k in range(batch_count)}
    layer_of = {id(v.value.handle): str(v.path).rsplit("/", 1)[0] for v in model.variables}
    if model.optimizer is not None:
        keys = sorted(((str(v.path).replace("/", "_"), v) for v in model.trainable_variables),
                      key=lambda kv: -len(kv[0]))
        for slot in model.optimizer.variables:
            name = str(slot.path).split("/", 1)[-1]
            owner = next((str(v.path).rsplit("/", 1)[0] for key, v in keys if name.startswith(key + "_")),
                         f"({model.optimizer.name})")
            layer_of[id(slot.value.handle)] = owner
    for variable in model.metrics_variables:
        layer_of.setdefault(id(variable.value.handle), LOSS)
    for k, captured in enumerate(concrete.captured_inputs):
        owners[batch_count + k] = layer_of.get(id(captured))
    return owners


class Owners:
    """(key, phase) of the buffer an instruction defines: a Keras layer path (or LOSS, an optimizer's
    own key) and one of the anatomy's phases; UNATTRIBUTED where nothing names it."""

    def __init__(self, index, scopes: dict[str, tuple[str, str]], parameters: dict[int, str | None]):
        self.index, self.parameters = index, parameters
        self.scopes = sorted(scopes.items(), key=lambda kv: -len(kv[0]))  # the longest scope first
        entry = index.entry if index is not None else None  # (None: a traced graph's ops only, of_op)
        self.entry_parameters = {ins.id: ins.parameter_number for ins in (entry.instructions if entry else ())
                                 if ins.opcode == "parameter"}

    def _variable(self, parameter_id: int) -> str | None:
        owner = self.parameters.get(self.entry_parameters.get(parameter_id, -1))
        return None if owner == BATCH else owner

    def _scope_of(self, op_name: str) -> tuple[str | None, str]:
        backward = op_name.startswith("gradient_tape/")
        name = op_name.split("/", 1)[1] if backward else op_name
        for scope, (kind, path) in self.scopes:
            if kind != "other" and (name == scope or name.startswith(scope + "/")):
                if kind == "optimizer":
                    return None, UPDATE
                if kind in ("loss", "metric"):
                    return LOSS, BACKWARD if backward else OTHER
                return path, BACKWARD if backward else FORWARD
        return None, BACKWARD if backward else ""

    def _walk(self, start, step, found, depth: int = 6):
        """Breadth first from `start` (itself first) along `step` (users or operands): the first
        answer `found` gives, and the instruction that gave it."""
        answer = found(start)
        if answer:
            return answer, start
        frontier, seen = [start], {start.id}
        for _ in range(depth):
            following = []
            for ins in frontier:
                for other in step(ins):
                    if other is None or other.id in seen:
                        continue
                    seen.add(other.id)
                    answer = found(other)
                    if answer:
                        return answer, other
                    following.append(other)
            frontier = following
        return None, None

    def _users(self, ins):
        return self.index.users.get(ins.id, ())

    def _operands(self, ins):
        return [self.index.by_id.get(o) for o in ins.operand_ids]

    def of(self, ins) -> tuple[str, str]:
        if ins is None:
            return UNATTRIBUTED, OTHER
        op_name, named = self.index.op_name(ins), ins
        if not op_name:  # made by XLA: the nearest consumer with an op names it
            op_name, named = self._walk(ins, self._users,
                                        lambda u: u.opcode != "tuple" and self.index.op_name(u))
            named = named or ins
        key, phase = self._scope_of(op_name) if op_name else (None, "")
        if key is None:  # an optimizer's buffer, or one no scope names: the variable it updates or reads
            if phase == UPDATE:
                key, _ = self._walk(named, self._users, lambda u: next(
                    (v for v in map(self._variable, u.operand_ids) if v), None))
            if key is None:
                key, _ = self._walk(named, self._operands, lambda o: self._variable(o.id))
            phase = phase or OTHER
        return (key, phase) if key is not None else (UNATTRIBUTED, OTHER)

    def of_op(self, op_name: str) -> tuple[str, str]:
        """(key, phase) of a TensorFlow op of the traced step, by the scope Keras entered for it."""
        key, phase = self._scope_of(op_name)
        if key is None:
            head = op_name.split("/", 2)[1 if op_name.startswith("gradient_tape/") else 0]
            key = f"({head})" if phase == UPDATE else f"(op {head})"
        return key, phase or OTHER
