"""The trainer protocol: what replay needs from a trainer, and the run directory it reads.

A user's own trainer plugs into replay by implementing :class:`Trainer`; the reference MoE
trainer in ``replay.reference`` is one implementation. Replay never imports a trainer's
internals: it builds one from the run config, restores a checkpoint read-only, and calls
:meth:`Trainer.train_step` on batches rebuilt by the loader.

The run directory a training run leaves (docs/design.md, "The run directory")::

    <run>/
      run_config.yaml       # the run config as used (model, mixture, dataset, global batch, seed, mesh, ...,
                            # trainer: the factory replay rebuilds the run with, replay.run.setup)
      env.json              # environment record (EnvRecord; replay.run.env writes it)
      events.jsonl          # one JSON object a line: {"event": ..., "step": ..., ...}
      fingerprints.jsonl    # one StepFingerprints.to_json() a line, appended every step
      signals.jsonl         # one StepSignals.to_json() a line, appended every step (screening)
      canary.jsonl          # one CanaryRecord a line per device, every canary_every steps (optional)
      *.pNNNNN.jsonl        # a run of several processes: process N >= 1's own devices' entries of the
                            # step logs above (replay.run.writer: who writes what; the readers merge)
      checkpoints/<step>/   # Orbax checkpoints: params, optimizer state, loader state
      quarantine.txt        # optional: device ids (one a line, '#' comments) held suspect
      suspects.json         # written by `replay scan`: its report, with "suspect_devices"
      canary/golden.json    # golden canary values per environment (replay canary, periodic canary)
      mixture.yaml          # the run's copy of the mixture config it trained with (paths made absolute)
      inputs.json           # what it trained with (InputsRecord): the mixture's sha256 and path, the manifest's
      superseded/           # steps abandoned by a restore, rollback or rewind (replay.run.lineage): their
                            # step-log lines (tagged attempt, superseded_by) and checkpoints

Every ``*.jsonl`` file is append-only, one JSON object a line, flushed line by line
(:func:`append_line`): a process killed mid-write leaves at most a torn last line, which every
reader skips. On a restart from checkpoint ``c`` the trainer moves the lines of steps ``>= c`` from
the step logs into ``superseded/`` before appending again (``RunDir.supersede``), so each step log
holds the run's lineage, one line a step. Events a trainer writes, each with ``attempt`` (the
attempt that wrote it: ``replay.run.lineage``) and ``t`` (Unix seconds): ``start`` and ``restore``
(each begins an attempt), ``checkpoint`` (only once the checkpoint has *committed*: with an
asynchronous save, after the commit, never at the call to save; ``save_start_t``, Unix seconds
when the save began, and ``commit_t``, when it committed, on the clock of ``t``: ``replay goodput``
measures the save interval and cost from them), ``checkpoint_failed``,
``phase_change``, ``skipped_window``, ``canary_mismatch`` (``devices``, ``verdict``), ``stopped``,
``end``. ``replay skip`` appends ``skip_window`` and ``rewind`` requests, which the next training
run follows.

Screening signals, for a user's own trainer (what ``replay scan`` reads; each optional, and a
check whose signal is missing says "not available"): inside the step, before the data-parallel
reduction, each device computes the float32 sum of squares of its local gradient contribution
(one fused reduction per leaf, ``jnp.sum(jnp.square(g.astype(jnp.float32)))``) and, per leaf, the
count of non-finite elements; after the reduction, optionally, ``<g_local, g_reduced>``. Then::

    signals = StepSignals(step=s, loss=..., grad_norm=...,
                          replicas=tuple(ReplicaNorm(r, devices_of_r, norm_sq_r, dot_r) for r ...),
                          devices={d: {"norm_sq": ..., "nonfinite": {leaf: n}} for d ...},
                          router=tuple(RouterLayerStats(...) for each MoE layer),
                          step_time_s=..., **replay.run.writer.input_signals(data.metrics()))
    append_line(os.path.join(run_dir, SIGNALS_NAME), signals.to_json())

Glossary: *step* is the global training step (the batch of step ``s`` holds global rows
``[s*B, (s+1)*B)``); *device id* is ``jax.Device.id``; *leaf path* is
``jax.tree_util.keystr`` of a parameter leaf; a *fingerprint* is the order-independent
integer fingerprint of docs/design.md ("Gradient fingerprints").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import typing
import zlib
from typing import Annotated, Any, Callable, Mapping, Optional, Protocol, TypeVar, Union, runtime_checkable

import pydantic
from pydantic import BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticSerializationError
from typing_extensions import NotRequired, TypedDict  # pydantic's TypedDict before Python 3.12 (a pydantic dependency)

from contract.validation import MISSING, adapter, first_error, where


FAULT_SITES = ("local_gradient", "expert_forward", "expert_backward", "attention", "optimizer_update")
"""Where a :class:`FaultSpec` flips its bit, in one device's computation of one step:

* ``local_gradient``: the device's finished local gradient contribution, after all communication
  of the step and before the data-parallel reduction (``leaf``, ``element``: flat index into the
  device's local shard of that leaf's gradient).
* ``expert_forward``: the output of the device's experts in MoE layer ``layer``, in the forward
  pass: under expert parallelism the buffer the device sends back at that layer's combine
  all-to-all (``element``: flat index into it; the trainer documents its layout).
* ``expert_backward``: the gradient of an expert weight (``leaf``: a layer's expert leaf, e.g.
  ``['layers'][1]['w_in']``) where the backward pass computes it on the device, before any
  reduction (``element``: flat index into the device's shard of that weight).
* ``attention``: the output of the attention block of layer ``layer`` (before the residual add)
  in the forward pass (``element``: flat index into the device's ``[rows, S, D]`` activation).

* ``optimizer_update``: one device's copy of the *updated train state*, after the optimizer update of
  the step (the gradients, and so the step's fingerprints, are right): ``leaf`` is a leaf path of the
  whole state (``jax.tree_util.keystr``: ``['params']['embed']``, an Adam moment
  ``['opt_state'][1][0].mu['embed']``), ``element`` a flat index into the device's local shard of it.
  A replicated leaf then holds a copy on that device that differs from the others': what the state
  fingerprint of the next checkpoint save finds (``replay.run.statefp``).

The middle three plant the error *inside* the computation, so that under expert parallelism it
reaches other devices through the all-to-alls within the same step."""

# ---- issue 27: sites inside the arithmetic, in transit and on the data path (one block: a later
# site, e.g. the optimizer update, is one more entry of FAULT_SITES and of SITE_BUFFERS' table).
INNER_SITES = (
    "ffn_up", "ffn_down", "ffn_up_grad_input", "ffn_up_grad_weight", "ffn_down_grad_input", "ffn_down_grad_weight",
    "attn_scores", "attn_probs", "attn_pv", "router_logits",
    "transit_dispatch", "transit_combine", "transit_dispatch_grad", "transit_combine_grad",
    "host_batch",
)
"""Fault sites that lie inside one device's arithmetic, on a link, or on the host, never at a buffer the
checker fingerprints next (``FaultSpec.where``; ``element`` is a flat index into the named buffer of
one device, whose shape the trainer gives: ``ReferenceTrainer.activation_shapes``):

* ``ffn_up``: the up-projection's output of layer ``layer``'s experts, *before* the nonlinearity
  (forward); ``ffn_down``: the down-projection's *input* (the nonlinearity's output), so the error
  passes through the down matmul's sum before anything is sent.
* ``ffn_up_grad_input`` / ``ffn_up_grad_weight``: the cotangent of the up-projection's output as it
  enters the activation-gradient product (``dx = g W_in^T``) or the weight-gradient product
  (``dW_in = x^T g``) of the backward pass, each alone; ``ffn_down_grad_input`` /
  ``ffn_down_grad_weight``: the same for the down projection (``dh = g W_out^T``, ``dW_out = h^T g``).
* ``attn_scores`` (``QK^T / sqrt(K)``, before the mask), ``attn_probs`` (the softmax output),
  ``attn_pv`` (``probs V``, before the output projection) of layer ``layer`` (forward).
* ``router_logits``: layer ``layer``'s router logits before the softmax and top-k (forward).
* ``transit_dispatch`` / ``transit_combine``: the buffer a device *received* at layer ``layer``'s
  dispatch / combine all-to-all, forward (the sender sent it right; part ``x`` came from the
  ``x``-th device of the expert group); ``transit_dispatch_grad`` / ``transit_combine_grad``: the
  cotangent received at their transposes in the backward pass.
* ``host_batch``: the ``inputs`` tokens of the device's rows after the loader handed the batch over
  (a host's memory or transfer; ``element``: flat index into the device's ``[rows, S]`` block;
  int32, bit flips only).

Besides a bit flip, a fault may scale the element or set it (``FaultSpec.mode``: ``"scale"``,
``"set"``, with NaN and Inf as values)."""

LAYER_SITES = ("expert_forward", "attention") + tuple(s for s in INNER_SITES if s != "host_batch")
"""The sites that take a ``FaultSpec.layer``."""
TRANSIT_SITES = ("transit_dispatch", "transit_combine", "transit_dispatch_grad", "transit_combine_grad")
FAULT_MODES = ("flip", "scale", "set")
FAULT_SITES = FAULT_SITES + INNER_SITES
# ---- end of issue 27's block


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """A simulated silent data corruption: flip one bit in one device's computation of one step.

    Attributes:
      step: the global step at which the fault fires.
      device_id: ``jax.Device.id`` of the device whose computation is corrupted.
      leaf: leaf path (``jax.tree_util.keystr``) of the parameter whose gradient is hit
        (``local_gradient``, ``expert_backward``), of the train state's leaf (``optimizer_update``);
        ``""`` for an activation (``expert_forward``, ``attention``).
      element: flat index into the corrupted buffer on that device (see :data:`FAULT_SITES`).
      bit: bit position in the element's bit pattern (0 = lowest mantissa bit).
      where: one of :data:`FAULT_SITES` (default ``local_gradient``, the drills' first kind).
      layer: the MoE layer of a fault at one of :data:`LAYER_SITES` (0-based); None for the
        others (an ``expert_backward`` fault's layer is its leaf's).
      mode: ``"flip"`` (default: bit ``bit`` of the element), ``"scale"`` (the element times
        ``value``) or ``"set"`` (the element becomes ``value``: NaN and Inf included).
      value: the factor or value of a scale or set fault (float32); ignored by a flip.

    Raises:
      ValueError: ``where`` is not a known site, or ``layer`` is missing (or given) where it must
        be given (or not).
    """

    step: int
    device_id: int
    leaf: str
    element: int
    bit: int
    where: str = "local_gradient"
    layer: Optional[int] = None
    mode: str = "flip"
    value: float = 0.0

    def __repr__(self) -> str:
        """The dataclass form, leaving out ``where`` and ``layer`` at their defaults (a local-gradient
        flip reads as it always has)."""
        extra = "" if self.where == "local_gradient" and self.layer is None else \
            f", where={self.where!r}" + (f", layer={self.layer!r}" if self.layer is not None else "")
        if self.mode != "flip":
            extra += f", mode={self.mode!r}, value={self.value!r}"
        return (f"FaultSpec(step={self.step!r}, device_id={self.device_id!r}, leaf={self.leaf!r}, "
                f"element={self.element!r}, bit={self.bit!r}{extra})")

    def __post_init__(self):
        if self.where not in FAULT_SITES:
            raise ValueError(f"FaultSpec.where: must be one of {list(FAULT_SITES)}, got {self.where!r}")
        needs_layer = self.where in LAYER_SITES
        if needs_layer and (self.layer is None or int(self.layer) < 0):
            raise ValueError(f"FaultSpec.layer: a {self.where} fault needs a layer >= 0, got {self.layer!r}")
        if not needs_layer and self.layer is not None:
            raise ValueError(f"FaultSpec.layer: only faults at {', '.join(LAYER_SITES)} take a layer "
                             f"(a {self.where} fault's is its leaf's, if any), got {self.layer!r}")
        if self.mode not in FAULT_MODES:
            raise ValueError(f"FaultSpec.mode: must be one of {list(FAULT_MODES)}, got {self.mode!r}")
        if self.mode != "flip" and self.where == "host_batch":
            raise ValueError("FaultSpec.mode: a host_batch fault flips a bit of an int32 token; scale and set "
                             "need a float buffer")


@dataclasses.dataclass(frozen=True)
class DriftSpec:
    """A simulated *persistent* small error on one device (a screening drill, ``replay drill
    --scenario drift``): from ``start`` to ``stop`` (exclusive; ``None``: to the end) the
    device's local gradient contribution, before the data-parallel reduction, is changed.

    Attributes:
      device_id: ``jax.Device.id`` of the faulty device.
      start: first global step of the error; stop: first step without it, or ``None``.
      magnitude: the relative error ``||delta|| / ||g_d||``, > 0; ``inf`` or ``nan`` make the
        gradient non-finite (``replay drill --scenario nonfinite``).
      kind: ``"scale"``: ``g_d * (1 + magnitude)`` (the local norm moves by the factor
        ``1 + magnitude``); ``"bias"``: each leaf ``+ magnitude * rms(leaf)`` (a constant offset
        of the same relative size: the norm moves only to second order, by about
        ``sqrt(1 + magnitude^2)``, so norm screening sees it far less); ``"expert_output"``: the
        output of the device's experts in every MoE layer times ``1 + magnitude``, inside the
        forward pass (under expert parallelism it reaches every data replica's gradient together,
        so replica-norm screening is blind to it; ``replay scan``'s ``expert_drift`` check is not).
    """

    device_id: int
    start: int
    magnitude: float
    stop: Optional[int] = None
    kind: str = "scale"

    def __post_init__(self):
        if self.kind not in ("scale", "bias", "expert_output"):
            raise ValueError(f"DriftSpec.kind: must be 'scale', 'bias' or 'expert_output', got {self.kind!r}")
        if not (self.magnitude > 0 or self.magnitude != self.magnitude):  # > 0, +inf, or NaN (a non-finite drill)
            raise ValueError(f"DriftSpec.magnitude: must be > 0 (or inf or nan), got {self.magnitude!r}")
        if self.stop is not None and self.stop <= self.start:
            raise ValueError(f"DriftSpec: stop {self.stop} must be > start {self.start}")

    def active(self, step: int) -> bool:
        return self.start <= step and (self.stop is None or step < self.stop)


# ----------------------------------------------------------------------------- run-log records, declared
#
# Each record of the step logs is a frozen standard-library dataclass (built every step by the trainer,
# without validation: nothing is added to the step's time) whose fields pydantic reads: it serializes a
# record to its JSON line (to_json: pydantic's plain values, then the standard library's json with sorted
# keys, so lines are byte for byte those of the hand-written writer before it), validates a line read
# back (from_dict: key path and value of a bad field; unknown keys ignored, so an older reader reads a
# newer line), and publishes the JSON Schema of each line (schemas/run_log/, replay.schema).

T = TypeVar("T")
_NullIsEmptyMap = Annotated[T, BeforeValidator(lambda v: {} if v is None else v)]  # null read as {}
_NullIsEmptyList = Annotated[T, BeforeValidator(lambda v: [] if v is None else v)]  # null read as []
_NotLogged = Annotated[T, Field(exclude=True), SkipJsonSchema()]  # carried in memory, never written
_Hex64 = Annotated[int, BeforeValidator(lambda v: int(v, 16) if isinstance(v, str) else v),
                   PlainSerializer(lambda v: f"{int(v):016x}", return_type=str),
                   WithJsonSchema({"type": "string", "pattern": "^[0-9a-f]{16}$"})]  # a 64-bit fingerprint, 16 hex


def _omitted(when: Callable[[Any], bool], **field: Any) -> Any:
    """A record field left out of its line when ``when(value)`` (empty, or None); ``field``: the
    ``dataclasses.field`` keywords (its default)."""
    return dataclasses.field(metadata={"omitted": when}, **field)


def _as_is(**field: Any) -> Any:
    """A record field of free-form values (``Any``: the router's figures) written as they are, not
    through pydantic's inference, which writes NaN and Inf inside them as null."""
    return dataclasses.field(metadata={"as_is": True}, **field)


def _empty(v: Any) -> bool:
    return not v


def _none(v: Any) -> bool:
    return v is None


class Record:
    """A run-log record: a frozen dataclass declared for pydantic (the section comment above).

    ``to_dict`` / ``to_json`` give its line; ``from_dict`` / ``from_json`` read one back.
    """

    __pydantic_config__ = ConfigDict(ser_json_inf_nan="constants")  # NaN and Inf written as json writes them

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values: device ids as string keys (JSON objects key by str), tuples as lists,
        fields marked omitted left out when empty."""
        try:
            out = adapter(type(self)).dump_python(self, mode="json", warnings=False)
        except PydanticSerializationError:  # a NumPy scalar a trainer left in it: as the number it holds
            out = adapter(type(self)).dump_python(_plain(self), mode="json", warnings=False)
        return _finish(self, out)

    def to_json(self) -> str:
        """One line of its step log (keys sorted, no newline; NaN/Inf written as Python's json does),
        sealed with its checksum (:func:`seal`)."""
        return json.dumps(seal(self.to_dict()), sort_keys=True)

    @classmethod
    def from_dict(cls: type[R], d: Mapping[str, Any]) -> R:
        """Inverse of :meth:`to_dict` (device ids back to int); unknown keys are ignored.

        Raises:
          ValueError: a required field is missing (``missing field 'loss'``) or a value is not of its type
            (``could not convert string to float: 'slow'``, or the key path and the value).
        """
        try:
            return adapter(cls).validate_python(d)
        except pydantic.ValidationError as e:
            raise ValueError(_record_problem(e, cls)) from None

    @classmethod
    def from_json(cls: type[R], line: str) -> R:
        """Parses one line of its step log."""
        return cls.from_dict(json.loads(line))


R = TypeVar("R", bound=Record)


def _finish(rec: Record, out: dict[str, Any]) -> dict[str, Any]:
    """``out`` (``rec`` dumped) without the fields :func:`_omitted` leaves out and with those :func:`_as_is`
    writes as they are, in ``rec`` and the records it holds."""
    marked, nested = _marks(type(rec))
    for name, when, as_is in marked:
        value = getattr(rec, name)
        if when is not None and when(value):
            out.pop(name, None)
        elif as_is:
            out[name] = _plain(dict(value))
    for name in nested:
        for item, dumped in zip(getattr(rec, name), out.get(name, ())):
            _finish(item, dumped)
    return out


@functools.cache
def _marks(cls: type) -> tuple[tuple[tuple[str, Any, bool], ...], tuple[str, ...]]:
    """``(marked, nested)`` of a record class, once: its fields with :func:`_omitted` or :func:`_as_is`
    ``(name, when, as_is)``, and its fields holding records that have such fields (a step's hot path)."""
    hints = typing.get_type_hints(cls)
    marked = tuple((f.name, f.metadata.get("omitted"), bool(f.metadata.get("as_is")))
                   for f in dataclasses.fields(cls) if f.metadata)
    nested = []
    for f in dataclasses.fields(cls):
        bare = _bare(hints[f.name])
        inner = [a for a in typing.get_args(bare) if isinstance(a, type) and issubclass(a, Record)]
        if typing.get_origin(bare) is tuple and any(_marks(a)[0] for a in inner):  # a tuple of records
            nested.append(f.name)
    return marked, tuple(nested)


def _bare(annotation: Any) -> Any:
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _plain(value: Any) -> Any:
    """``value`` with the NumPy scalars in it (dict keys too) made the Python numbers they hold."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is dict:
        return {_plain(k): _plain(v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return kind(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                                             if f.init})
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value.item() if hasattr(value, "item") and hasattr(value, "dtype") else value


_PLAIN = frozenset({int, float, str, bool, type(None)})


def _record_problem(e: pydantic.ValidationError, cls: type) -> str:
    """The first problem of a record read back, in the words its readers always used."""
    errors = e.errors(include_url=False)
    err = first_error(errors, cls)
    loc, value = [p for p in err["loc"] if p != "[key]"], err.get("input")
    if err["type"] in MISSING:
        return f"missing field {where(loc)!r}"
    if err["type"] == "float_parsing":
        return f"could not convert string to float: {value!r}"
    if err["type"] == "int_parsing":
        return f"invalid literal for int() with base 10: {value!r}"
    return f"{where(loc) or cls.__name__}: {err['msg']}, got {value!r}"


class DeviceSignals(TypedDict):
    """One device's entry of :class:`StepSignals` ``devices``."""

    norm_sq: float
    """float32 ||g_d||^2 of the device's local gradient contribution, before the reduction"""
    nonfinite: Mapping[str, int]
    """per leaf path, its NaN + Inf count (only leaves with a non-zero count); {} when none"""


_DeviceSignals = Annotated[DeviceSignals, BeforeValidator(
    lambda v: {**v, "nonfinite": v.get("nonfinite") or {}} if isinstance(v, Mapping) else v)]


SEND_COLLECTIVES = ("dispatch", "combine")
SEND_DIRECTIONS = ("forward", "backward")


def send_site(layer: int, collective: str, direction: str) -> str:
    """The name of an all-to-all *send site*: ``"layer{layer}.{collective}.{direction}"``.

    Under expert parallelism every MoE layer exchanges four buffers per step, each device sending
    one to every device of its expert group (``StepFingerprints.sends`` fingerprints what each
    device sent at each site):

    * ``dispatch.forward``: a device sends its tokens' capacity slots to the devices of their experts;
    * ``combine.forward``: a device sends its experts' outputs back to the tokens' devices;
    * ``combine.backward``: a device sends the cotangent of the expert outputs it received (the
      transpose of the combine) to the experts' devices;
    * ``dispatch.backward``: a device sends the cotangent of the tokens it received (the transpose
      of the dispatch) back to the tokens' devices.

    Raises:
      ValueError: a negative layer, or an unknown collective or direction.
    """
    if int(layer) < 0 or collective not in SEND_COLLECTIVES or direction not in SEND_DIRECTIONS:
        raise ValueError(f"send site: layer >= 0, collective in {list(SEND_COLLECTIVES)} and direction in "
                         f"{list(SEND_DIRECTIONS)}; got {layer!r}, {collective!r}, {direction!r}")
    return f"layer{int(layer)}.{collective}.{direction}"


def parse_send_site(name: str) -> tuple[int, str, str]:
    """Inverse of :func:`send_site`: ``(layer, collective, direction)``.

    Raises:
      ValueError: ``name`` is not a send site's name.
    """
    parts = str(name).split(".")
    if len(parts) == 3 and parts[0].startswith("layer") and parts[0][5:].isdigit():
        layer, collective, direction = int(parts[0][5:]), parts[1], parts[2]
        if collective in SEND_COLLECTIVES and direction in SEND_DIRECTIONS:
            return layer, collective, direction
    raise ValueError(f"not a send site name: {name!r} (expected 'layer<L>.<dispatch|combine>.<forward|backward>')")


def send_sites_in_program_order(n_layers: int) -> tuple[str, ...]:
    """The send sites of an ``n_layers`` MoE model in the order one step executes them: the forward
    pass layer by layer (dispatch, then combine), then the backward pass from the last layer down
    (the combine's transpose, then the dispatch's)."""
    fwd = [send_site(i, c, "forward") for i in range(n_layers) for c in SEND_COLLECTIVES]
    bwd = [send_site(i, c, "backward") for i in reversed(range(n_layers)) for c in reversed(SEND_COLLECTIVES)]
    return tuple(fwd + bwd)


@dataclasses.dataclass(frozen=True)
class StepFingerprints(Record):
    """What one train step computed, in integers that compare bit for bit.

    Attributes:
      step: global step.
      loss_bits: float32 bit pattern of the loss, as an unsigned int.
      grad_norm_bits: float32 bit pattern of the global gradient norm.
      batch_hash: fingerprint of the batch's ``inputs`` tokens (hex string).
      leaves: per leaf path, ``{"fp": int, "nan": int, "inf": int}`` of the reduced gradient.
      devices: per device id, per leaf path, the fingerprint (int) of that device's local
        gradient contribution before the data-parallel reduction.
      router: router health figures (per-expert token share, dropped fraction, entropy,
        z-loss), floats, for humans; never compared bit for bit.
      device_coords: per device id, its mesh coordinates ``{axis name: index}``, so that a
        replay on another device set can match shards by position (added; default empty).
      send_sites: the all-to-all send sites of the step in program order (:func:`send_site`,
        :func:`send_sites_in_program_order`); empty when the trainer exchanges nothing (gather
        dispatch) or does not fingerprint its sends.
      sends: per device id, aligned with ``send_sites``, the 64-bit fingerprint of the whole buffer
        the device sent there (every destination's part). The first site, in program order, at
        which a device's send differs from a replay's names the device that computed wrong: the
        others' later differences follow from what it sent them (``replay.verify.localize``).
      recvs: per device id, aligned with ``send_sites``, the 64-bit fingerprints of each *part* of the
        buffer the device received there (part ``i`` from the ``i``-th device of its expert group, each
        part fingerprinted as its own array, so a part received equals the part its sender sent bit for
        bit). A part received wrong while every send matched names the link, sender -> receiver
        (``replay.verify.localize``); empty when the trainer does not fingerprint what it receives.
      signals: the step's screening signals (:class:`StepSignals`) when the trainer computes
        them; not part of ``fingerprints.jsonl`` (the training loop writes them, with its
        timings, to ``signals.jsonl``), never compared.

    One line of ``fingerprints.jsonl`` is :meth:`to_json` (keys sorted; device ids as strings; the send
    fields only when the step has send sites, so a gather-dispatch line is unchanged); :meth:`from_dict`
    reads one back (unknown keys ignored).
    """

    step: int
    loss_bits: int
    grad_norm_bits: int
    batch_hash: str
    leaves: Mapping[str, Mapping[str, int]]
    devices: Mapping[int, Mapping[str, int]]
    router: Mapping[str, Any] = _as_is(default_factory=dict)
    device_coords: Mapping[int, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    send_sites: tuple[str, ...] = _omitted(_empty, default=())
    sends: _NullIsEmptyMap[Mapping[int, tuple[int, ...]]] = _omitted(_empty, default_factory=dict)
    recvs: _NullIsEmptyMap[Mapping[int, tuple[tuple[int, ...], ...]]] = _omitted(_empty, default_factory=dict)
    signals: _NotLogged[Optional[StepSignals]] = dataclasses.field(default=None, compare=False, repr=False)

    def bits_equal(self, other: "StepFingerprints") -> bool:
        """True when every bit-compared field (all but ``router``) is equal."""
        a, b = self.to_dict(), other.to_dict()
        a.pop("router"), b.pop("router")
        return a == b


@dataclasses.dataclass(frozen=True)
class RouterLayerStats(Record):
    """Router health of one MoE layer at one step, over the whole global batch.

    Attributes:
      entropy: mean router entropy per routed token, nats (at most ``ln E``).
      expert_share: per expert, its share of the step's assignments before capacity (sums to 1).
      dropped_fraction: assignments past expert capacity / all assignments, in [0, 1].
      max_logit: the largest router logit of any routed token (large logits precede
        router collapse; ST-MoE's z-loss keeps them small).
      z_loss: mean over routed tokens of ``logsumexp(router logits)^2`` (ST-MoE eq. 5).
      aux_loss: load-balancing loss ``E * sum_e f_e * P_e`` (Switch Transformer eq. 4), mean
        over rows.
    """

    entropy: float
    expert_share: tuple[float, ...]
    dropped_fraction: float
    max_logit: float
    z_loss: float
    aux_loss: float

@dataclasses.dataclass(frozen=True)
class ExpertLoad(Record):
    """How many tokens each expert device received in one MoE layer at one step (expert parallelism).

    Attributes:
      received: per device id, the capacity slots of the device's experts that the layer's dispatch
        all-to-all filled with tokens, counted over every device of its expert group (assignments
        kept after capacity; an int).
      max_over_mean: ``max_d received[d] / mean_d received[d]`` over the layer's devices: 1 when the
        load is even; the device with the most tokens is the layer's slowest expert group (its
        expert matmuls are the longest once the exchange is ragged, and with capacity padding it
        is the one that drops first); 0.0 when no token was routed.
      output_sq: per device id, the float32 sum of squares of its experts' output (optional).
      probe: per device id, the 64-bit fingerprint of its experts' output for a fixed probe token
        (optional; JSON: 16 hex digits): devices holding the same experts agree bit for bit when they
        compute right (``replay scan``'s ``expert_drift``).
    """

    received: Mapping[int, int]
    max_over_mean: float
    output_sq: _NullIsEmptyMap[Mapping[int, float]] = _omitted(_empty, default_factory=dict)
    probe: _NullIsEmptyMap[Mapping[int, _Hex64]] = _omitted(_empty, default_factory=dict)

    @classmethod
    def from_counts(cls, received: Mapping[int, int], output_sq: Optional[Mapping[int, float]] = None,
                    probe: Optional[Mapping[int, int]] = None) -> "ExpertLoad":
        """Computes ``max_over_mean`` from the counts. ``output_sq``: per device id, the float32 sum of
        squares of its experts' output in the layer (the buffer it sends back at the combine), which
        ``replay scan``'s ``expert_drift`` check divides by ``received``; ``probe``: per device id, the
        64-bit fingerprint of its experts' output for a fixed probe token (equal on devices holding the
        same experts when they compute right: ``replay.reference.model.expert_probe_input``); optional."""
        vals = [int(v) for v in received.values()]
        mean = sum(vals) / len(vals) if vals else 0.0
        return cls(received={int(d): int(v) for d, v in received.items()},
                   max_over_mean=(max(vals) / mean) if mean > 0 else 0.0,
                   output_sq={int(d): float(v) for d, v in (output_sq or {}).items()},
                   probe={int(d): int(v) for d, v in (probe or {}).items()})

@dataclasses.dataclass(frozen=True)
class ReplicaNorm(Record):
    """One data-parallel replica's local gradient contribution at one step.

    A *replica* is the set of devices that together compute one contribution, over their own
    rows of the global batch, before the data-parallel reduction. In the reference trainer the
    batch is split over every mesh axis and expert weights are gathered for compute, so each
    device is a replica of its own (under expert parallelism too: a device's contribution is then
    the gradient of the replicated weights from its rows and its own experts' shard, and screening
    compares those per device); in a trainer with tensor or pipeline parallelism a replica
    spans devices that each hold a disjoint shard of it, and its ``norm_sq`` is the sum of
    theirs.

    Attributes:
      replica: replica index (row-major over the mesh positions of its first device).
      devices: its device ids.
      norm_sq: float32 ``||g_r||^2`` of its contribution ``g_r`` (before the reduction).
      dot: float32 ``<g_r, g>`` with the reduced gradient ``g = sum_r g_r``, or None when the
        trainer does not keep ``g_r`` past the reduction. Exactly (up to float rounding)
        ``sum_r dot_r = ||g||^2``: the per-replica figures reconcile with the global norm
        (squared norms alone cannot: ``||sum g_r||^2`` has cross terms).
    """

    replica: int
    devices: tuple[int, ...]
    norm_sq: float
    dot: Optional[float] = None

@dataclasses.dataclass(frozen=True)
class StepSignals(Record):
    """The screening signals of one step: one line of ``signals.jsonl`` (floats, never compared
    bit for bit; ``replay scan`` reads them).

    Attributes:
      step: global step.
      loss: the step's loss (float32 value).
      grad_norm: global gradient norm of the reduced gradient (float32 value).
      replicas: per data-parallel replica, :class:`ReplicaNorm`.
      devices: per device id ``{"norm_sq": float32 ||g_d||^2 of the device's local
        contribution before the reduction, "nonfinite": {leaf path: NaN + Inf count}}`` (only
        leaves with a non-zero count are listed).
      router: per MoE layer, in layer order, :class:`RouterLayerStats`.
      expert_load: per MoE layer, in layer order, :class:`ExpertLoad` (expert parallelism only;
        empty when the experts are not on their own devices).
      step_time_s: wall seconds of the train step (dispatch to results on the host), or None.
      loader_wait_s: seconds the step waited for its batch (the loader's
        ``metrics()["wait_s_last_step"]``), or None; loader_occupancy: batches ready in the
        prefetch buffer when the trainer asked for the step's batch (``metrics()["occupancy_at_ask"]``;
        0: it waited; a stall shows here first), or None.
      loader_occupancy_min: the buffer's lowest level from the previous batch's take to this
        one's (``metrics()["occupancy_min"]``), or None.
      loader_wait_stages: where the wait went, seconds per loader stage (``metrics()["wait_stages_s"]``:
        ``index``, ``read`` (storage), ``decode``, ``rows``, ``transfer`` (to the devices), ``other``;
        ``{}`` when the batch was ready), or None (not recorded).
      t: wall clock (Unix seconds) when the step's work ended, after its checkpoint save call:
        consecutive steps' ``t`` bound the interval that ``replay goodput`` splits into the parts
        below (None: not recorded).
      compile_s: seconds of JAX tracing, lowering and compilation inside the train step (the first
        step of an attempt compiles), or None.
      canary_s: seconds of the periodic canary run before the step (0 when none ran), or None.
      checkpoint_s: seconds the loop was blocked saving a checkpoint after the step (the
        asynchronous save's device-to-host copy; 0 when none), or None.
      tokens: non-padding tokens of the step's batch that this process read (the loader's
        ``tokens_served`` difference; the global count in a single-process run, and in a multi-process
        run once the readers have added the other processes' lines: ``read_signals``), or None.
    """

    step: int
    loss: float
    grad_norm: float
    replicas: tuple[ReplicaNorm, ...] = ()
    devices: _NullIsEmptyMap[Mapping[int, _DeviceSignals]] = dataclasses.field(default_factory=dict)
    router: tuple[RouterLayerStats, ...] = ()
    expert_load: _NullIsEmptyList[tuple[ExpertLoad, ...]] = _omitted(_empty, default=())
    step_time_s: Optional[float] = None
    loader_wait_s: Optional[float] = None
    loader_occupancy: Optional[int] = None
    loader_occupancy_min: Optional[int] = _omitted(_none, default=None)
    loader_wait_stages: Optional[Mapping[str, float]] = _omitted(_none, default=None)
    t: Optional[float] = _omitted(_none, default=None)
    compile_s: Optional[float] = _omitted(_none, default=None)
    canary_s: Optional[float] = _omitted(_none, default=None)
    checkpoint_s: Optional[float] = _omitted(_none, default=None)
    tokens: Optional[int] = _omitted(_none, default=None)


@dataclasses.dataclass(frozen=True)
class CanaryRecord(Record):
    """One device's result of one periodic canary: one line of ``canary.jsonl``.

    Attributes:
      step: the global step before which the canary ran.
      device: ``jax.Device.id``.
      signature: sha256 of the device's ``{leaf: fingerprint}`` of the canary gradient.
      status: ``"ok"``, ``"differs_from_golden"``, ``"differs_from_majority"`` or
        ``"no_majority"`` (``replay.run.canary.decide_canary``).
      golden: ``"matched"``, ``"created"`` (this canary made the golden value) or another
        ``CanaryDecision.golden_status``.
      canary: the canary's name (its batch, rows and weights).
      seconds: wall seconds of the whole canary (all devices at once).
    """

    step: int
    device: int
    signature: str
    status: str
    golden: str = ""
    canary: str = ""
    seconds: float = 0.0


@runtime_checkable
class Trainer(Protocol):
    """A trainer that replay can drive.

    Implementations must be deterministic: the same state and batch on the same mesh give
    bit-identical fingerprints.
    """

    def init_state(self, mesh: Any, seed: int) -> Any:
        """Returns a fresh train state (parameters and optimizer state) placed on ``mesh``."""

    def restore(self, run_dir: str, step: int, mesh: Any) -> tuple[Any, Mapping[str, Any]]:
        """Restores, read-only, the checkpoint saved at ``step`` onto ``mesh``.

        Returns ``(train_state, loader_state_dict)``.

        Raises:
          FileNotFoundError: there is no checkpoint at ``step``.
        """

    def train_step(
        self, state: Any, batch: Mapping[str, Any], step: int, fault: Optional[FaultSpec] = None
    ) -> tuple[Any, StepFingerprints]:
        """Runs one optimizer step on ``batch`` (the loader's global arrays).

        ``fault``, when given and ``fault.step == step``, flips the bit it names before the
        data-parallel reduction (a drill); a trainer may also accept a :class:`DriftSpec` or a
        list of faults (screening drills). Returns the new state and the step's fingerprints,
        whose ``signals`` carry the step's :class:`StepSignals` when the trainer computes them.
        """


# --- Run directory names and readers (added with the reference trainer) ------------------

RUN_CONFIG_NAME = "run_config.yaml"
ENV_NAME = "env.json"
EVENTS_NAME = "events.jsonl"
FINGERPRINTS_NAME = "fingerprints.jsonl"
SIGNALS_NAME = "signals.jsonl"
CANARY_NAME = "canary.jsonl"
SUSPECTS_NAME = "suspects.json"
CHECKPOINTS_DIR = "checkpoints"
QUARANTINE_NAME = "quarantine.txt"
SUPERSEDED_DIR = "superseded"  # step-log lines and checkpoints of superseded steps (replay.run.lineage)
INPUTS_NAME = "inputs.json"  # what the run trained with: its mixture's and manifest's hashes (replay.run.inputs)
MIXTURE_COPY_NAME = "mixture.yaml"  # the run's copy of its mixture config (paths absolute)


LINE_CHECK = "crc32"
"""The key of a step-log line's checksum (:func:`seal`)."""


_CHANGED = ("it was changed after it was written (a disk, a copy or an edit), so what it says of this step is not "
            "what the run computed: restore the file from a backup, or leave the step out")


def _line_crc(record: Mapping[str, Any]) -> str:
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(body.encode('utf-8', 'surrogatepass')):08x}"


def seal(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` (a step-log line's JSON object) with its checksum under :data:`LINE_CHECK`.

    The checksum is CRC-32 (``zlib.crc32``, IEEE 802.3) of the record's canonical JSON: keys sorted,
    no spaces, NaN and Inf as Python's json writes them, UTF-8; 8 hex digits. A line read back is
    checked by :func:`line_damage`: a changed digit anywhere (a disk, a copy, an edit) fails it with
    probability 1 - 2**-32, any burst of up to 32 flipped bits always does. It guards the log, not the
    devices: a fingerprint a faulty device computed is logged and sealed as it came, so a checked line
    that disagrees with a replay still convicts its device, while a line changed after it was written
    is a damaged log (``replay`` exit 5), never a device fault.
    """
    out = {k: v for k, v in record.items() if k != LINE_CHECK}
    out[LINE_CHECK] = _line_crc(out)
    return out


def line_damage(d: Mapping[str, Any]) -> Optional[str]:
    """Why a step-log line read back (its JSON object) is not the line its writer sealed, or None: the
    line is intact, or carries no checksum (written before 2026-12-07, or by a writer that does not seal:
    read unchecked, as before)."""
    if LINE_CHECK not in d:
        return None
    want = d[LINE_CHECK]
    got = _line_crc({k: v for k, v in d.items() if k != LINE_CHECK})
    if want == got:
        return None
    return f"the line is damaged: its {LINE_CHECK} {want!r} does not match its content ({got!r}); {_CHANGED}"


RUN_LINE_CHECK = "step_log_check"
"""The key of ``env.json`` by which a run says that its writer sealed every line of its step logs from
its first (value :data:`LINE_CHECK`; :meth:`replay.run.writer.RunDir.write_env` writes it, at the
run's fresh start only): then a line without a checksum is damaged wherever it is. Runs without it
(written before 2026-12-07 evening, or by a writer of their own) keep :class:`SealCheck`'s older rule."""


def seals_every_line(env: Any) -> bool:
    """Whether a run's environment record (``env.json``, parsed) says :data:`RUN_LINE_CHECK`."""
    return isinstance(env, Mapping) and env.get(RUN_LINE_CHECK) == LINE_CHECK


def run_seals_every_line(run_dir: str) -> bool:
    """:func:`seals_every_line` of ``<run_dir>/env.json``; False when it is absent or unreadable (its own
    readers report that)."""
    try:
        with open(os.path.join(run_dir, ENV_NAME), encoding="utf-8") as f:
            return seals_every_line(json.load(f))
    except (OSError, ValueError):
        return False


class SealCheck:
    """:func:`line_damage` for the lines of one file in order, plus the rule for a line without a checksum.
    In a run that seals every line (``every_line``: :func:`seals_every_line` of its env.json) it is
    damaged wherever it is (its checksum removed with the rest of an edit). Elsewhere, lines before the
    file's first sealed line are read unchecked (a run written before 2026-12-07, or resumed since by a
    writer that seals), but one after a sealed line is damaged. ``check(d)`` returns why, or None."""

    def __init__(self, every_line: bool = False) -> None:
        self.sealed = False
        self.every_line = every_line

    def check(self, d: Mapping[str, Any]) -> Optional[str]:
        if LINE_CHECK in d:
            self.sealed = True
            return line_damage(d)
        if self.every_line:
            return (f"the line is damaged: it carries no {LINE_CHECK} where its run's writer sealed every line "
                    f"(env.json {RUN_LINE_CHECK}); {_CHANGED}")
        if self.sealed:
            return f"the line is damaged: it carries no {LINE_CHECK} where the lines before it in its file do; {_CHANGED}"
        return None


def step_of(d: Mapping[str, Any]) -> Optional[int]:
    """The step a line names, as an int: an int, or a float or decimal string holding one (a damaged line may
    hold either, and the record's parser would take it); None when it names none."""
    v = d.get("step")
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return int(f) if f.is_integer() else None


def append_line(path: str, line: str) -> None:
    """Appends one JSON line to a run-log file and flushes it (append-only: a process killed
    mid-write leaves at most a torn last line, which every reader skips)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()


def shard_name(name: str, process: int) -> str:
    """The file of process ``process`` (>= 1) of the step log ``name``: ``fingerprints.p00001.jsonl``
    (``replay.run.writer``: process 0 writes the main file, each other process its own)."""
    stem, _, ext = name.rpartition(".")
    return f"{stem}.p{int(process):05d}.{ext}"


def log_files(run_dir: str, name: str) -> list[tuple[int, str]]:
    """``(process, path)`` of every existing file of the step log ``name`` (``fingerprints.jsonl``,
    ``signals.jsonl``, ``canary.jsonl``): the main file (process 0) first, then the other processes'
    shards in process order."""
    import re

    stem, _, ext = name.rpartition(".")
    pattern = re.compile(rf"^{re.escape(stem)}\.p(\d{{5}})\.{re.escape(ext)}$")
    out = [(0, os.path.join(run_dir, name))] if os.path.exists(os.path.join(run_dir, name)) else []
    try:
        names = os.listdir(run_dir)
    except OSError:
        names = []
    shards = sorted((int(m.group(1)), os.path.join(run_dir, n)) for n in names if (m := pattern.match(n)))
    return out + [x for x in shards if x[0] > 0]


class StepLogLineError(ValueError):
    """A line of a step log holds a value its reader cannot use; the message starts ``<file>:<line>:``."""


def read_raw_lines(path: str, numbered: bool = False) -> list:
    """The JSON objects of a step log file, one a line (with ``numbered``, ``(line number, object)``
    pairs); a torn (or otherwise unparsable) *last* line is skipped, an unparsable line elsewhere raises
    ``ValueError`` naming the file and line, and a whole line whose checksum fails (:func:`line_damage`)
    a :class:`StepLogLineError` naming them."""
    with open(path, encoding="utf-8") as f:
        lines = [(n, x) for n, x in enumerate(f.read().split("\n"), 1) if x.strip()]
    out = []
    seals = SealCheck(run_seals_every_line(os.path.dirname(os.path.abspath(path))))
    for i, (n, line) in enumerate(lines):
        try:
            d = json.loads(line)
            if not isinstance(d, dict) or "step" not in d:
                raise ValueError("not an object with a step")
        except ValueError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{n}: not a valid entry ({e!r})") from None
        damage = seals.check(d)
        if damage is not None:  # whole JSON, so not torn: changed after it was written
            raise StepLogLineError(f"{path}:{n}: {damage}")
        out.append((n, d) if numbered else d)
    return out


def merge_step_parts(main: Mapping[str, Any], parts: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One step's record from the primary's line and the other processes' lines of that step (their
    per-device ``devices`` and ``sends`` entries, and for signals their ``replicas``): the record one
    process would have written."""
    out = dict(main)
    if parts:
        out["devices"] = dict(main.get("devices") or {})
        reps = list(main.get("replicas") or [])
        for p in parts:
            out["devices"].update(p.get("devices") or {})
            reps += list(p.get("replicas") or [])
            if p.get("sends"):  # all-to-all send fingerprints, per device like ``devices``
                out["sends"] = {**(out.get("sends") or {}), **p["sends"]}
            if p.get("tokens") is not None and out.get("tokens") is not None:  # each process its own reads
                out["tokens"] = int(out["tokens"]) + int(p["tokens"])
        if "replicas" in main or any("replicas" in p for p in parts):
            out["replicas"] = sorted(reps, key=lambda r: r.get("replica", 0))
    return out


def read_merged_steps(run_dir: str, name: str) -> tuple[dict[int, dict], dict[int, dict[int, dict]]]:
    """``({step: the primary's line}, {process: {step: its line}})`` of the step log ``name`` (a later line
    for a step wins, as after a resume).

    Raises:
      FileNotFoundError: the main file does not exist. ValueError: a malformed line (not the last of its file).
    """

    files = log_files(run_dir, name)
    if not files or files[0][0] != 0:
        raise FileNotFoundError(os.path.join(run_dir, name))
    main = {int(d["step"]): d for d in read_raw_lines(files[0][1])}
    shards = {p: {int(d["step"]): d for d in read_raw_lines(path)} for p, path in files[1:]}
    return main, shards


def _read_merged(run_dir: str, name: str, parse) -> dict[int, Any]:
    """``{step: parse(merged record)}``; a record that does not parse is a :class:`StepLogLineError`
    naming the file and line it came from (the primary's line, or the other process's whose part breaks it)."""
    main, shards = read_merged_steps(run_dir, name)
    out = {}
    for s, d in main.items():
        parts = [sh[s] for sh in shards.values() if s in sh]
        try:
            out[s] = parse(merge_step_parts(d, parts))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            why = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise StepLogLineError(f"{_line_of(run_dir, name, s, d, parts, parse)}: unreadable ({why})") from None
    return out


def _line_of(run_dir: str, name: str, step: int, main: Mapping[str, Any], parts: list, parse) -> str:
    """``<file>:<line>`` of the line of ``step`` that breaks its record: the primary's when it does not
    parse alone, else the first other process's whose part breaks the merge (read again: only on an error)."""
    files = log_files(run_dir, name)
    try:
        parse(merge_step_parts(main, []))
        culprit = next((k for k in range(1, len(parts) + 1) if _fails(parse, main, parts[:k])), 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        culprit = 0
    seen = 0
    for _, path in files:
        lines = [n for n, d in read_raw_lines(path, numbered=True) if int(d["step"]) == step]
        if not lines:
            continue
        if seen == culprit:
            return f"{path}:{lines[-1]}"  # a later line for a step wins
        seen += 1
    return files[0][1]


def _fails(parse, main: Mapping[str, Any], parts: list) -> bool:
    try:
        parse(merge_step_parts(main, parts))
    except (ValueError, KeyError, TypeError, AttributeError):
        return True
    return False


def _read_lines(path: str, parse) -> list:
    """``parse(dict)`` of each line of ``path`` (:func:`read_raw_lines`); an entry that does not parse is
    skipped when it is the last (torn), else a ``ValueError`` naming the file and entry."""
    rows = read_raw_lines(path)
    out = []
    for i, d in enumerate(rows):
        try:
            out.append(parse(d))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            if i == len(rows) - 1:
                break
            raise ValueError(f"{path}: entry {i + 1} is not valid ({e!r})") from None
    return out


def read_signals(run_dir: str) -> dict[int, StepSignals]:
    """Reads ``<run_dir>/signals.jsonl`` (and the other processes' ``signals.pNNNNN.jsonl``) into
    ``{step: StepSignals}`` (a later line for a step wins).

    Raises:
      FileNotFoundError: the file does not exist. ValueError: a malformed line (not the last);
      StepLogLineError (a ValueError): a line with a value of the wrong type, named ``<file>:<line>``.
    """
    return _read_merged(run_dir, SIGNALS_NAME, StepSignals.from_dict)


def read_canary(run_dir: str) -> list[CanaryRecord]:
    """Reads ``<run_dir>/canary.jsonl`` and the other processes' ``canary.pNNNNN.jsonl`` (by step, then device).

    Raises:
      FileNotFoundError: the file does not exist. ValueError: a malformed line (not the last).
    """

    files = log_files(run_dir, CANARY_NAME)
    if not files or files[0][0] != 0:
        raise FileNotFoundError(os.path.join(run_dir, CANARY_NAME))
    out = []
    for _, path in files:
        try:
            out += _read_lines(path, CanaryRecord.from_dict)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a valid entry ({e!r})") from None
    return sorted(out, key=lambda c: (c.step, c.device)) if len(files) > 1 else out


def read_fingerprints(run_dir: str) -> dict[int, StepFingerprints]:
    """Reads ``<run_dir>/fingerprints.jsonl`` (with the other processes' ``fingerprints.pNNNNN.jsonl``)
    into ``{step: StepFingerprints}``.

    A later line for the same step replaces an earlier one (the trainer truncates on
    restart, so this only matters for files written by other tools). A torn last line (a
    process killed mid-write) is skipped.

    Raises:
      FileNotFoundError: the file does not exist. ValueError: a malformed line (not the last).
    """
    return _read_merged(run_dir, FINGERPRINTS_NAME, StepFingerprints.from_dict)


class Event(TypedDict):
    """One line of ``events.jsonl`` (module docstring: who writes which event). Every event has ``event`` and
    ``step``; a trainer's own kinds and fields are allowed. The fields below are typed wherever an event
    carries them."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc] - a trainer's own fields are kept
    event: str
    """start, restore, checkpoint, checkpoint_failed, phase_change, skipped_window, canary_mismatch,
    non_finite, non_finite_state, state_replicas_disagree, stopped, end (the training loop); skip_window,
    rewind (replay skip, the next training run follows them); or a trainer's own"""
    step: int
    """the global step the event is at"""
    t: NotRequired[float]
    """Unix seconds (microseconds) when it was written"""
    time: NotRequired[str]
    """the same, ISO 8601, UTC, readable"""
    attempt: NotRequired[Optional[int]]
    """the attempt that wrote it (replay.run.lineage)"""
    checkpoint: NotRequired[int]
    """restore, rewind, skip_window: the checkpoint restored from, or to rewind to"""
    previous_end: NotRequired[int]
    """restore, rewind: the end of the lineage before it"""
    reason: NotRequired[str]
    """restore (resume, rollback, ...), stopped, skip_window, rewind: why"""
    kind: NotRequired[str]
    """rewind: rewind, rollback or non_finite"""
    start: NotRequired[int]
    """skipped_window, skip_window: the window's first step"""
    end: NotRequired[int]
    """skipped_window, skip_window: the window's last step (inclusive)"""
    stop: NotRequired[int]
    """skip_window: the first step after the window"""
    save_start_t: NotRequired[float]
    """checkpoint, checkpoint_failed: Unix seconds when the save began"""
    commit_t: NotRequired[float]
    """checkpoint: Unix seconds when it committed"""
    state: NotRequired[dict[str, Any]]
    """checkpoint: what it carries of the checkpoint's state record (replay.run.statefp.event_fields)"""
    phase: NotRequired[int]
    """phase_change: the mixture phase from this step on"""
    devices: NotRequired[list[int]]
    """canary_mismatch, stopped, state_replicas_disagree: the devices named"""
    suspects: NotRequired[list[int]]
    """state_replicas_disagree: the devices named and every copy of a shard whose copies have no majority
    (one of them is wrong; the copies alone cannot say which)"""


class EnvBackend(TypedDict):
    """``env.json``'s ``backend``: the JAX backend a process ran on."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    platform: NotRequired[str]
    """cpu, gpu, tpu"""
    device_kind: NotRequired[str]
    """jax.Device.device_kind of the first device (replay goodput's peak FLOP/s by kind)"""
    device_count: NotRequired[int]
    local_device_count: NotRequired[int]
    process_index: NotRequired[int]
    process_count: NotRequired[int]
    """processes of the run: each p >= 1 writes its own fingerprints.pNNNNN.jsonl"""
    platform_version: NotRequired[Optional[str]]
    collectives: NotRequired[Optional[str]]
    """what reduces across devices on CPU (in-process, gloo, mpi); None on accelerators"""
    cpu_threads: NotRequired[int]
    """XLA:CPU's intra-op thread count (CPU only)"""


class EnvMesh(TypedDict):
    """``env.json``'s ``mesh``: the run's device mesh (its contents are judged against the devices by the
    replay's set-up, which names what a malformed one lacks)."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    axis_names: NotRequired[list[str]]
    """the mesh axes' names, outermost first (["data", "expert"])"""
    shape: NotRequired[list[int]]
    """the size of each axis"""
    device_ids: NotRequired[list[int]]
    """jax.Device.id of each device in mesh order"""
    device_coords: NotRequired[dict[str, dict[str, int]]]
    """per device id (a string) its coordinate on each axis ({"0": {"data": 0, "expert": 0}})"""


class EnvDevice(TypedDict):
    """A device of ``env.json``'s ``devices`` (keyed by its id, a string)."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    process: int
    local: int
    """its index among its process's devices, in id order"""
    host: str
    kind: str


class EnvProcess(TypedDict):
    """A process of ``env.json``'s ``processes``."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    index: int
    host: str
    devices: list[int]


class EnvRecord(TypedDict):
    """``env.json``: what decides the bits a step computes (``replay.run.env.record_environment``), which a
    replay compares with its own. Every field is optional (a user's trainer may record less; a check that
    needs one says so) and others are kept; the fields below are typed wherever present."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    versions: NotRequired[dict[str, Optional[Union[str, int]]]]
    """python, jax, jaxlib, numpy, optax, orbax-checkpoint, grain, ml_dtypes (None: not installed), and
    fingerprint (an int: replay.run.fingerprint.FINGERPRINT_VERSION; absent: 1)"""
    env: NotRequired[dict[str, str]]
    """the environment variables that change what XLA compiles (replay.run.env.RELEVANT_ENV_VARS) that were set"""
    jax_config: NotRequired[dict[str, Any]]
    """the jax.config flags that change numerics or random streams"""
    backend: NotRequired[EnvBackend]
    mesh: NotRequired[EnvMesh]
    hostname: NotRequired[str]
    """process 0's host"""
    python_executable: NotRequired[str]
    devices: NotRequired[dict[str, EnvDevice]]
    """per global device id: where it ran (what reports name a device by)"""
    processes: NotRequired[list[EnvProcess]]
    step_log_check: NotRequired[str]
    """"crc32": the run's writer sealed every line of its step logs from its first (RUN_LINE_CHECK)"""


class InputsMixture(TypedDict):
    """``inputs.json``'s ``mixture``."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    sha256: str
    """contract.config.MixtureConfig.sha256() of the mixture it trained with"""
    path: NotRequired[Optional[str]]
    """the run config's mixture path"""
    copy: NotRequired[Optional[str]]
    """the run's copy of the mixture config, relative to the run directory (default mixture.yaml)"""


class InputsDataset(TypedDict):
    """``inputs.json``'s ``dataset``."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    manifest_sha256: str
    """sha256 of the dataset's manifest.json bytes"""
    path: NotRequired[Optional[str]]
    """the run config's dataset path"""


class InputsRecord(TypedDict):
    """``inputs.json``: what a run trained with (``replay.run.inputs``, written at its first start): its
    mixture config (sha256, path, the run's copy), its dataset (the manifest's sha256) and the loader's
    schedule."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    version: NotRequired[int]
    mixture: InputsMixture
    dataset: InputsDataset
    schedule: NotRequired[Optional[dict[str, Any]]]
    """the loader's Schedule.to_dict() without skip windows (sources, records, phases, global_batch, seed,
    max_period)"""


def record_problem(d: Any, cls: Any) -> Optional[str]:
    """Why ``d`` (a parsed JSON file or line) is not a ``cls`` (:class:`EnvRecord`, :class:`InputsRecord`,
    ...), or None: ``missing field 'mixture.sha256'``, or the key path and what is wrong. Strict, as JSON
    gives them (an int is not ``"3"``, nor ``true``)."""
    if not isinstance(d, dict):
        return f"must be a JSON object, got {type(d).__name__}"
    try:
        adapter(cls).validate_python(d, strict=True)
    except pydantic.ValidationError as e:
        return _record_problem(e, cls)
    return None


EVENT_HELP = ("a line of events.jsonl is a JSON object with 'event' (a string) and 'step' (an int), its other "
              "fields typed as schemas/run_log/event.schema.json says (a trainer's own kinds and fields are kept): "
              "correct that line or delete it")


def event_problem(d: Any) -> Optional[str]:
    """Why ``d`` (one parsed line of ``events.jsonl``) is not an :class:`Event`, or None: ``missing field
    'step'``, or the key path and what is wrong (``step: Input should be a valid integer, got '3'``).
    Strict, as JSON gives them: ``step`` an int (not ``"3"``, not ``true``), ``t`` a number. A trainer's
    own kinds and extra fields pass unchecked (the protocol allows them)."""
    return record_problem(d, Event)


def read_events(run_dir: str) -> list[dict[str, Any]]:
    """Reads ``<run_dir>/events.jsonl`` (one dict per event, in order). A line that is not JSON is skipped
    (a torn line: a kill mid-write, which a resumed run may have appended to); every other line must be
    an :class:`Event` (:func:`event_problem`; its JSON Schema is ``schemas/run_log/event.schema.json``).

    Raises:
      OSError: the file cannot be read. ValueError: a line is JSON but not an event (``<file>:<line>:
        not an event: <key path>: <what is wrong>`` and what to do).
    """

    path = os.path.join(run_dir, EVENTS_NAME)
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                why = event_problem(d)
                if why is not None:
                    raise ValueError(f"{path}:{n}: not an event: {why}; {EVENT_HELP}")
                out.append(d)
    return out
