"""The reference MoE decoder: plain JAX, small, real.

Dimension letters (as in ``jax.nn.dot_product_attention``'s docstring):

    B  rows in the (local) batch          S  sequence length (slots per packed row)
    D  model width                        V  vocabulary size
    H  attention heads                    K  head width (Dh)
    E  experts                            C  expert capacity (slots per expert per row)
    F  expert hidden width                R  router top-k (experts per token)

Architecture, per layer (pre-norm)::

    x = x + Attention(RMSNorm(x))       causal, and only within the same packed document
    x = x + MoE(RMSNorm(x))             top-R router, capacity C per expert per row

* **Attention** uses rotary position embeddings on ``inputs_position`` (positions restart
  at 0 in each packed document), and the mask ``causal(q >= k) AND seg[q] == seg[k] AND
  seg[q] != 0``: no token attends across a document boundary or to padding. Masked scores
  are set to -1e30 before a float32 softmax, so their weights are exactly 0.
* **MoE** (GShard/Switch style, Lepikhin et al. 2020, Fedus et al. 2021): router logits and
  softmax in float32; top-R experts per token with the R gates renormalized to sum to 1
  (Mixtral); each row is one routing group with capacity
  ``C = max(1, ceil(capacity_factor * S * R / E))`` slots per expert; assignments take slots
  first by rank (all first choices, then all second choices, ...) then by position, and
  an assignment past capacity is dropped (the token's residual passes it unchanged).
  Padding tokens (segment 0) are not routed. Outputs are combined by gathering each
  token's R expert outputs and summing them in rank order, so a token's output does not
  depend, even in the last bit, on which slots other tokens took. Because the group is the row, a row's result
  does not depend on which other rows share its device: the same batch gives the same
  per-row values on 1 or 8 devices.
* **Dispatch** (``ModelConfig.dispatch``): ``gather``: every device runs every expert on its
  own rows' slots ``[B, E, C, D]``. ``all_to_all`` (expert parallelism, inside ``shard_map``
  over the mesh's ``expert`` axis of ``X`` devices, each holding ``E / X`` experts): the slots
  go to their experts' devices by ``jax.lax.all_to_all`` as ``[X, E/X, B, C, D]`` (part ``x``
  to the ``x``-th device), the experts run on what they received, and a second all-to-all
  brings the outputs back; routing, capacity and combine are the same, so the two agree up to
  float32 rounding. The exchanges are ``custom_vjp`` functions whose backward pass (itself an
  all-to-all of the cotangent) can fingerprint what the device sends (:class:`Hooks`).
* **Losses** (Switch Transformer eqs. 4-6; ST-MoE, Zoph et al. 2022, eq. 5 for z-loss):
  cross entropy over targets with ``targets_segmentation != 0``;
  load balancing ``E * sum_e f_e * P_e`` per row and layer (``f_e``: share of the row's
  assignments routed to ``e`` before capacity, ``P_e``: mean router probability of ``e``);
  router z-loss ``logsumexp(router_logits)^2`` per routed token and layer.

:func:`local_loss` returns one device's *contribution* to the global loss: sums over its
rows divided by global totals, so that the global loss and gradient are the plain sum of
the devices' contributions (what the trainer's ``psum`` computes and what replay checks
device by device).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

from contract.validation import Int, IntUpTo, Number, OneOf, section
from replay.run import fingerprint as fpm
from replay.run.protocol import FAULT_SITES

BATCH_KEYS = (
    "inputs",
    "targets",
    "inputs_segmentation",
    "targets_segmentation",
    "inputs_position",
    "targets_position",
)
_MASK_VALUE = -1e30
DISPATCH_MODES = ("gather", "all_to_all")


class ModelConfigError(ValueError):
    """A model size or weight is out of range; the message names it and the allowed range."""


@section("model", ModelConfigError)
class ModelConfig:
    """Sizes of the reference MoE decoder (the run config's ``model:``; a frozen pydantic dataclass:
    ``ModelConfig(...)``, ``dataclasses.replace`` and ``ModelConfig.from_dict`` raise
    :class:`ModelConfigError` naming the key, its value and the allowed range).

    Attributes:
      vocab_size: V, >= 2.
      d_model: D, >= 1.
      n_layers: >= 1.
      n_heads: H, >= 1.
      head_dim: K, even (rotary embedding), >= 2.
      n_experts: E, >= 1.
      top_k: R, in ``[1, n_experts]``.
      d_ff: F, expert hidden width, >= 1.
      capacity_factor: > 0; ``C = max(1, ceil(capacity_factor * S * R / E))``.
      aux_loss_weight: weight of the load-balancing loss, >= 0.
      z_loss_weight: weight of the router z-loss, >= 0.
      router_bias_rate: loss-free load balancing (DeepSeek-V3, Liu et al. 2024, sec. 2.1.2; Wang
        et al. 2024, "Auxiliary-loss-free load balancing"): per layer a per-expert bias ``b`` is
        added to the router logits for the top-R *choice* only (gates stay the unbiased
        probabilities; DeepSeek-V3 adds it to sigmoid affinities, the logits are a softmax
        router's additive scale), and after every step ``b_e += rate * (mean_e' n_e' - n_e) / mean_e' n_e'``
        with ``n_e`` the step's assignments to expert ``e`` (:func:`router_bias_update`). >= 0; 0
        turns it off (the bias stays 0).
      dispatch: how tokens reach their experts. ``"gather"``: every device runs every expert on
        its own rows (the trainer gathers the expert weights for the step). ``"all_to_all"``: expert
        parallelism: each device holds ``n_experts / expert`` experts (the mesh's ``expert`` axis),
        sends each expert's capacity slots to its device with ``jax.lax.all_to_all`` and gets the
        outputs back with a second one; the weights are never gathered. Routing, capacity and
        drops are the same in both (per-row capacity ``C``), so with no drop the two give the same
        loss and gradients up to float32 rounding (docs/trainer.md, "Expert parallelism").
      param_dtype: ``"float32"`` or ``"bfloat16"`` (parameters, activations and gradients;
        router, softmax, norms and loss are float32 either way).
      rope_theta: rotary base, > 0.
      init_std: standard deviation of the normal initializer, > 0.
    """

    vocab_size: Int("an int >= 2", ge=2)
    d_model: Int("an int >= 1", ge=1) = 64
    n_layers: Int("an int >= 1", ge=1) = 2
    n_heads: Int("an int >= 1", ge=1) = 4
    head_dim: Int("an even int >= 2", ge=2, multiple_of=2) = 16
    n_experts: Int("an int >= 1", ge=1) = 4
    top_k: IntUpTo(1, "n_experts") = 2
    d_ff: Int("an int >= 1", ge=1) = 128
    capacity_factor: Number("> 0", gt=0) = 1.25
    aux_loss_weight: Number(">= 0", ge=0) = 0.01
    z_loss_weight: Number(">= 0", ge=0) = 1e-3
    router_bias_rate: Number(">= 0", ge=0) = 0.0
    dispatch: OneOf(DISPATCH_MODES, " or ".join(repr(m) for m in DISPATCH_MODES)) = "gather"
    param_dtype: OneOf(("float32", "bfloat16"), "'float32' or 'bfloat16'") = "float32"
    rope_theta: Number("> 0", gt=0) = 10000.0
    init_std: Number("> 0", gt=0) = 0.02

    def capacity(self, seq_len: int) -> int:
        """Expert capacity C for rows of ``seq_len`` tokens (formula in the module docstring)."""
        return max(1, math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts))

    @property
    def dtype(self):
        return jnp.bfloat16 if self.param_dtype == "bfloat16" else jnp.float32


def init_params(cfg: ModelConfig, key: jax.Array) -> dict[str, Any]:
    """Returns the parameter pytree (normal(0, init_std) weights, ones for norm scales).

    Leaves (dtype ``cfg.param_dtype``): ``embed`` [V, D]; per layer ``layers[i]``:
    ``attn_norm`` [D], ``wq``/``wk``/``wv`` [D, H, K], ``wo`` [H, K, D], ``moe_norm`` [D],
    ``router`` [D, E], ``w_in`` [E, D, F], ``w_out`` [E, F, D]; ``final_norm`` [D];
    ``unembed`` [D, V].
    """
    D, H, K, E, F, V = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.n_experts, cfg.d_ff, cfg.vocab_size
    dt = cfg.dtype
    counter = iter(range(1 << 30))

    def normal(shape, fan_in=None):
        std = cfg.init_std if fan_in is None else 1.0 / math.sqrt(fan_in)
        return (std * jax.random.normal(jax.random.fold_in(key, next(counter)), shape, jnp.float32)).astype(dt)

    layers = []
    for _ in range(cfg.n_layers):
        layers.append(
            {
                "attn_norm": jnp.ones((D,), dt),
                "wq": normal((D, H, K), D),
                "wk": normal((D, H, K), D),
                "wv": normal((D, H, K), D),
                "wo": normal((H, K, D), H * K),
                "moe_norm": jnp.ones((D,), dt),
                "router": normal((D, E), D),
                "w_in": normal((E, D, F), D),
                "w_out": normal((E, F, D), F),
            }
        )
    return {
        "embed": normal((V, D)),
        "layers": layers,
        "final_norm": jnp.ones((D,), dt),
        "unembed": normal((D, V), D),
    }


def _rms_norm(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x: jnp.ndarray, positions: jnp.ndarray, theta: float) -> jnp.ndarray:
    """Rotary embedding (Su et al. 2021). x: [B, S, H, K]; positions: int32 [B, S]."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = positions.astype(jnp.float32)[..., None] * freq  # [B, S, K/2]
    sin, cos = jnp.sin(ang)[:, :, None, :], jnp.cos(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention_mask(segment_ids: jnp.ndarray) -> jnp.ndarray:
    """bool [B, S_q, S_k]: ``k <= q`` and same non-zero segment (no cross-document attention)."""
    S = segment_ids.shape[-1]
    causal = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same & (segment_ids != 0)[:, :, None]


def _attention(p, x, segment_ids, positions, cfg: ModelConfig, hooks: "Hooks" = None, layer: int = 0):
    """Attention block; ``hooks``: the drill's faults at ``attn_scores`` ([B, H, S, S] float32, before
    the mask), ``attn_probs`` ([B, H, S, S]) and ``attn_pv`` ([B, S, H, K]) of ``layer``."""
    hooks = Hooks() if hooks is None else hooks
    q = _rope(jnp.einsum("bsd,dhk->bshk", x, p["wq"]), positions, cfg.rope_theta)
    k = _rope(jnp.einsum("bsd,dhk->bshk", x, p["wk"]), positions, cfg.rope_theta)
    v = jnp.einsum("bsd,dhk->bshk", x, p["wv"])
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32) / math.sqrt(cfg.head_dim)
    scores = _inner(scores, hooks, "attn_scores", layer)
    mask = attention_mask(segment_ids)[:, None]
    scores = jnp.where(mask, scores, _MASK_VALUE)
    probs = _inner(jax.nn.softmax(scores, axis=-1).astype(x.dtype), hooks, "attn_probs", layer)
    out = _inner(jnp.einsum("bhqs,bshk->bqhk", probs, v), hooks, "attn_pv", layer)
    return jnp.einsum("bqhk,hkd->bqd", out, p["wo"])


# ----------------------------------------------------------------------------- instrumentation

FAULT_LEN = 9
"""The traced fault input: ``int32[9] = [enabled, device_id, leaf_index, element, bit, site, layer, mode,
value]``; ``site`` is the index of the fault's ``where`` in ``replay.run.protocol.FAULT_SITES``, ``mode``
0 flip / 1 scale / 2 set (``replay.run.protocol.FAULT_MODES``), ``value`` the float32 bit pattern of a
scale's factor or a set's value."""
SITE_CODE = {name: i for i, name in enumerate(FAULT_SITES)}
_COMBINE, _DISPATCH = 0, 1  # probe slots: the transposes run combine first (backward order)


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Static description of expert parallelism inside ``shard_map``: experts split over the mesh
    axis ``axis`` of ``size`` devices (``n_experts % size == 0``)."""

    axis: str
    size: int


@dataclasses.dataclass(frozen=True)
class Hooks:
    """One device's instrumentation of a forward/backward pass (traced values, all optional).

    Attributes:
      fault: the traced fault input (:data:`FAULT_LEN`), or None (no fault can fire: the plain program).
      device: int32 scalar, this device's id (compared with ``fault[1]``).
      probes: float32 ``[L, 2, 1 + X, 4]`` zeros, differentiated: the backward pass writes the
        fingerprint of what this device sends at each transposed all-to-all (slot 0: the combine's
        transpose, slot 1: the dispatch's; row 0) and of each part it receives there (row ``1 + i``: from
        the ``i``-th device of its expert group) into their cotangents, as four exact 16-bit halves
        (:func:`probe_fingerprints` reads them back). None: no send or receive fingerprints.
    """

    fault: Any = None
    device: Any = None
    probes: Any = None
    drift: Any = None  # float32[4] drift input (ReferenceTrainer.drift_array): kind 2 scales the experts' output

    def drifting_output(self):
        """bool scalar: an ``expert_output`` drift is active on this device (None: no drift input)."""
        if self.drift is None:
            return None
        d = self.drift
        return (d[0] == 1) & (d[1] == self.device.astype(jnp.float32)) & (d[2] == 2)

    def drift_output(self, out: jnp.ndarray) -> jnp.ndarray:
        """``out`` x(1 + magnitude) where an ``expert_output`` drift is active on this device, else ``out``.

        The factor is 1 off the drift, so the unselected branch's gradient is ``0 x 1``: a NaN or Inf
        magnitude (the ``nonfinite`` drill) does not reach the gradient of a device that is not drifting
        (``jnp.where(c, out * (1 + nan), out)`` would send ``0 x nan`` back through the all-to-all to every
        device's tokens)."""
        drifting = self.drifting_output()
        if drifting is None:
            return out
        return jnp.where(drifting, out * _drift_factor(drifting, self.drift[3], out.dtype), out)

    def hit(self, site: str, layer: int, leaf: Any = None):
        """bool scalar: the fault fires here (this device, this site and layer / leaf)."""
        if self.fault is None:
            return None
        f = self.fault
        on = (f[0] == 1) & (f[1] == self.device) & (f[5] == SITE_CODE[site]) & (f[6] == layer)
        return on if leaf is None else on & (f[2] == leaf)


def expert_probe_input(d_model: int, dtype: Any) -> jnp.ndarray:
    """The experts' probe token: a fixed ``[d_model]`` vector of RMS 1 (``cos(0.7 i + 0.3)``, normalized), the
    same on every device and at every step."""
    v = jnp.cos(jnp.arange(d_model, dtype=jnp.float32) * 0.7 + 0.3)
    return (v * jax.lax.rsqrt(jnp.mean(v * v))).astype(dtype)


def _drift_factor(drifting, magnitude, dtype) -> jnp.ndarray:
    """``1 + magnitude`` where ``drifting``, else exactly 1 (scalar of ``dtype``)."""
    return jnp.where(drifting, 1.0 + magnitude, 1.0).astype(dtype)


def _expert_probe(w_in, w_out, drifting, magnitude) -> jnp.ndarray:
    """uint32[2]: the fingerprint lanes of this device's experts' output for the probe token
    (:func:`expert_probe_input`), ``w_out^T gelu(w_in^T probe)`` per local expert, no gradient.

    Devices holding the same experts (twins on other data replicas) hold bit-identical weights, so a
    healthy device's probe fingerprint equals its twins' at every step; ``replay scan``'s ``expert_drift``
    check compares them. A drifting device (``drifting``, the ``expert_output`` drift) computes every expert
    output x(1 + ``magnitude``), the probe's too: a persistent fault of the chip applies to each
    computation at its site."""
    w_in, w_out = jax.lax.stop_gradient(w_in), jax.lax.stop_gradient(w_out)
    probe = jnp.broadcast_to(expert_probe_input(w_in.shape[1], w_in.dtype), (w_in.shape[0], 1, w_in.shape[1]))
    h = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", probe, w_in))
    out = jnp.einsum("ecf,efd->ecd", h, w_out)
    out = jnp.where(drifting, out * _drift_factor(drifting, magnitude, out.dtype), out)
    return fpm.fingerprint(out, counts=False)[:2]


def _halves(fp) -> jnp.ndarray:
    """uint32 ``[fp0, fp1, ...]`` -> float32[4] of its two lanes' 16-bit halves (exact)."""
    lo = jnp.uint32(0xFFFF)
    return jnp.stack([fp[0] & lo, fp[0] >> 16, fp[1] & lo, fp[1] >> 16]).astype(jnp.float32)


def probe_fingerprints(probe_cotangents) -> jnp.ndarray:
    """uint32 ``[..., 2]`` lanes ``(fp0, fp1)`` from probe cotangents float32 ``[..., 4]``."""
    h = probe_cotangents.astype(jnp.uint32)
    return jnp.stack([h[..., 0] | (h[..., 1] << 16), h[..., 2] | (h[..., 3] << 16)], axis=-1)


def _send_fingerprint(x) -> jnp.ndarray:
    """uint32[2] lanes of the fingerprint of a send buffer (no NaN/Inf counts)."""
    return fpm.fingerprint(x, counts=False)[:2]


def _part_fingerprints(x) -> jnp.ndarray:
    """uint32 ``[X, 2]``: the fingerprint lanes of each part ``x[i]`` of an exchanged buffer, each part
    indexed from 0 (so a part sent and the same part received have the same value)."""
    return jnp.stack([fpm.fingerprint(x[i], counts=False)[:2] for i in range(x.shape[0])])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _exchange(x, probe, fault, on_bwd, axis):
    """``jax.lax.all_to_all`` over ``axis`` (``x``: ``[X, ...]``, part ``i`` to device ``i``; the result's
    part ``i`` came from device ``i``) whose backward pass, itself an all-to-all of the cotangent,
    also fingerprints the cotangent it sends and each part of the cotangent it receives, and returns
    them as ``probe``'s cotangent (float32 ``[1 + X, 4]``: row 0 the send, row ``1 + i`` the part received
    from device ``i``; axlearn's ``_ragged_all_to_all`` also wraps its exchange in a ``custom_vjp``).
    ``fault``/``on_bwd``: a transit fault in the cotangent *received* (:func:`corrupt_element`), or None."""
    return jax.lax.all_to_all(x, axis, 0, 0)


def _exchange_fwd(x, probe, fault, on_bwd, axis):
    return jax.lax.all_to_all(x, axis, 0, 0), (fault, on_bwd)


def _exchange_bwd(axis, res, g):
    fault, on_bwd = res
    got = jax.lax.all_to_all(g, axis, 0, 0)
    if fault is not None:
        got = corrupt_element(got, fault, on_bwd)
    rows = [_halves(_send_fingerprint(g))] + [_halves(fp) for fp in _part_fingerprints(got)]
    return got, jnp.stack(rows), None, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def corrupt_element(x, fault, on):
    """``x`` with one element corrupted where ``on``: ``fault[7]`` (mode) 0 flips bit ``fault[4]`` of flat
    element ``fault[3]`` (``replay.run.fingerprint.flip_bit``), 1 multiplies it by the float32 whose bits
    are ``fault[8]``, 2 sets it to that value (NaN, Inf included). Disabled, the result is ``x`` bit for
    bit. The element index is clipped into range."""
    mode = fault[7]
    x = fpm.flip_bit(x, fault[3], fault[4], on & (mode == 0))
    e = jnp.clip(jnp.asarray(fault[3], jnp.int32), 0, max(x.size - 1, 0))
    at = jnp.unravel_index(e, x.shape) if x.ndim else ()
    one = (1,) * x.ndim
    old = jax.lax.dynamic_slice(x, at, one)
    v = jax.lax.bitcast_convert_type(fault[8], jnp.float32)
    oldf = old.astype(jnp.float32)
    new = jnp.where(on & (mode == 1), oldf * v, jnp.where(on & (mode == 2), v, oldf)).astype(x.dtype)
    new = jnp.where(on & (mode != 0), new, old)  # disabled or a flip: the element as it is, bit for bit
    return jax.lax.dynamic_update_slice(x, new, at)


@jax.custom_vjp
def _corrupt_value(x, fault, on):
    """A fault in a forward value (:func:`corrupt_element`); the backward pass is the identity (the backward
    computes from the wrong value with its own, correct, formulas)."""
    return corrupt_element(x, fault, on)


def _corrupt_value_fwd(x, fault, on):
    return corrupt_element(x, fault, on), None


def _corrupt_value_bwd(_, g):
    return g, None, None


_corrupt_value.defvjp(_corrupt_value_fwd, _corrupt_value_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_with_faults(spec, a, b, fault, on_a, on_b):
    """``jnp.einsum(spec, a, b)`` whose backward pass corrupts the output's cotangent (:func:`corrupt_element`)
    where it enters the product for ``a``'s gradient (``on_a``: the activation gradient) or the one for
    ``b``'s (``on_b``: the weight gradient), each alone; both products are the plain ``jax.vjp`` of the
    einsum, so a disabled fault leaves every bit as autodiff computes it."""
    return jnp.einsum(spec, a, b)


def _einsum_with_faults_fwd(spec, a, b, fault, on_a, on_b):
    return jnp.einsum(spec, a, b), (a, b, fault, on_a, on_b)


def _einsum_with_faults_bwd(spec, res, g):
    a, b, fault, on_a, on_b = res
    _, vjp = jax.vjp(lambda u, w: jnp.einsum(spec, u, w), a, b)
    da = vjp(corrupt_element(g, fault, on_a))[0]
    db = vjp(corrupt_element(g, fault, on_b))[1]
    return da, db, None, None, None


_einsum_with_faults.defvjp(_einsum_with_faults_fwd, _einsum_with_faults_bwd)


def _inner(x, hooks: "Hooks", site: str, layer: int):
    """``x`` with the drill's forward fault at ``site`` of ``layer`` (:func:`_corrupt_value`), or ``x``."""
    on = hooks.hit(site, layer)
    return x if on is None else _corrupt_value(x, hooks.fault, on)


def _matmul(spec, a, b, hooks: "Hooks", site: str, layer: int):
    """``einsum(spec, a, b)``, with the drill's backward faults ``<site>_grad_input`` / ``<site>_grad_weight``
    (:func:`_einsum_with_faults`) when the step carries a fault input."""
    if hooks.fault is None:
        return jnp.einsum(spec, a, b)
    return _einsum_with_faults(spec, a, b, hooks.fault, hooks.hit(f"{site}_grad_input", layer),
                               hooks.hit(f"{site}_grad_weight", layer))


@jax.custom_vjp
def _corrupt_cotangent(w, fault, on):
    """Identity on a weight in the forward pass; a drill's fault (:func:`corrupt_element`) in its gradient
    where the backward pass computes it (before any reduction)."""
    return w


def _corrupt_cotangent_fwd(w, fault, on):
    return w, (fault, on)


def _corrupt_cotangent_bwd(res, g):
    fault, on = res
    return corrupt_element(g, fault, on), None, None


_corrupt_cotangent.defvjp(_corrupt_cotangent_fwd, _corrupt_cotangent_bwd)


def _maybe_flip(x, hooks: Hooks, site: str, layer: int, leaf: Any = None, backward: bool = False):
    on = hooks.hit(site, layer, leaf)
    if on is None:
        return x
    return (_corrupt_cotangent if backward else _corrupt_value)(x, hooks.fault, on)


# ----------------------------------------------------------------------------- the model


def _moe(p, x, valid, cfg: ModelConfig, bias=None, *, ep: Optional[ExpertParallel] = None,
         hooks: Hooks = Hooks(), layer: int = 0, leaf_index: tuple = (None, None)):
    # Over 120 lines (126, 22 of them its docstring): routing, capacity, dispatch, the experts and the
    # combine of one layer, in the order the program runs them, so that the fault sites and send
    # fingerprints placed between them read in program order (the localization's order).
    """MoE feed-forward of one layer.

    Args:
      p: the layer's ``router`` [D, E], ``w_in`` [E', D, F], ``w_out`` [E', F, D] (``E' = E`` with
        gather dispatch; this device's ``E / X`` experts under expert parallelism).
      x: [B, S, D]; valid: bool [B, S] (routed tokens).
      bias: float32 [E] added to the router logits for the top-R choice only (loss-free
        balancing, ``ModelConfig.router_bias_rate``), or None.
      ep: expert parallelism (inside ``shard_map`` over ``ep.axis``), or None: gather dispatch.
      hooks: drill faults and send fingerprints (:class:`Hooks`); layer: this layer's index;
        leaf_index: the flat leaf indices of this layer's ``w_in`` and ``w_out`` (expert_backward faults).

    Returns:
      ``(y [B, S, D], stats)``; stats (float32 scalars unless said, sums over this device's
      rows): ``lb_sum``, ``z_sum``, ``entropy_sum``, ``tokens`` (routed tokens), ``assigned``
      [E] (assignments before capacity), ``dropped`` (assignments past capacity),
      ``max_logit`` (largest router logit of a routed token; -inf when none), ``kept`` [E]
      (assignments that took a slot); under expert parallelism with ``hooks.probes``, ``sends``
      uint32 [2, 2]: the fingerprint lanes of what this device sent at the forward dispatch and
      combine all-to-alls, and ``recvs`` uint32 [2, X, 2]: those of each part it received there
      (part ``i`` from the ``i``-th device of its expert group; :func:`_part_fingerprints`).

    The steps, each a function: :func:`_route` (router, top-R), :func:`_slots` (capacity),
    :func:`_dispatch` (gather into expert slots), the experts (here; under expert parallelism
    :func:`_experts_exchanged`: all-to-all, experts, all-to-all back), :func:`_combine`, and
    :func:`_router_stats`.
    """
    C = cfg.capacity(x.shape[1])
    logits, probs, idx, gate = _route(p, x, cfg, bias, hooks, layer)
    assign, slot_of, assigned, kept = _slots(idx, valid, cfg.n_experts, C)
    expert_in = _dispatch(x, idx, slot_of, kept, cfg.n_experts, C)
    w_in = _maybe_flip(p["w_in"], hooks, "expert_backward", layer, leaf_index[0], backward=True)
    w_out = _maybe_flip(p["w_out"], hooks, "expert_backward", layer, leaf_index[1], backward=True)
    if ep is None:
        extra = {}
        pre = _inner(_matmul("becd,edf->becf", expert_in, w_in, hooks, "ffn_up", layer), hooks, "ffn_up", layer)
        h = _inner(jax.nn.gelu(pre), hooks, "ffn_down", layer)
        expert_out = _matmul("becf,efd->becd", h, w_out, hooks, "ffn_down", layer)
        expert_out = _maybe_flip(expert_out, hooks, "expert_forward", layer)
        expert_out = hooks.drift_output(expert_out)  # every expert computed here (the canary's program)
    else:
        expert_out, extra = _experts_exchanged(expert_in, w_in, w_out, ep, hooks, layer)
        drifting = hooks.drifting_output()
        if drifting is not None:  # each expert device's output for a fixed token, compared with its twins'
            extra["probe"] = _expert_probe(p["w_in"], p["w_out"], drifting, hooks.drift[3])
    y = _combine(expert_out, idx, slot_of, gate, kept, x.dtype)
    return y, {**_router_stats(logits, probs, assign, idx, assigned, kept, valid, cfg), **extra}


def _route(p, x, cfg: ModelConfig, bias, hooks: Hooks, layer: int):
    """The router: ``(logits, probs)`` float32 [B, S, E] and each token's top-R experts ``idx`` int32
    [B, S, R] with their gates (renormalized over the R) [B, S, R]."""
    R = cfg.top_k
    logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32), p["router"].astype(jnp.float32))
    logits = _inner(logits, hooks, "router_logits", layer)  # [B, S, E] float32, before softmax and top-k
    probs = jax.nn.softmax(logits, axis=-1)  # [B, S, E] float32
    if bias is None:
        gate, idx = jax.lax.top_k(probs, R)  # [B, S, R]
    else:  # the bias decides which experts, never how much (DeepSeek-V3 eq. 16), in logit units
        _, idx = jax.lax.top_k(logits + bias.astype(jnp.float32), R)
        gate = jnp.take_along_axis(probs, idx, axis=-1)
    gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
    return logits, probs, idx, gate


def _slots(idx, valid, E: int, C: int):
    """Capacity: ``assign`` int32 [B, S, R, E] (one-hot, routed tokens only), each assignment's slot in its
    expert ``slot_of`` [B, S, R] (rank-major, then position: GShard priority), ``assigned`` [B, S, R]
    0/1, and ``kept`` [B, S, R] 0/1 (the assignment took one of the expert's ``C`` slots)."""
    B, S, R = idx.shape
    assign = jax.nn.one_hot(idx, E, dtype=jnp.int32) * valid[:, :, None, None].astype(jnp.int32)  # [B,S,R,E]
    by_rank = jnp.transpose(assign, (0, 2, 1, 3)).reshape(B, R * S, E)
    slot = (jnp.cumsum(by_rank, axis=1) - 1) * by_rank
    slot = jnp.transpose(slot.reshape(B, R, S, E), (0, 2, 1, 3))  # [B,S,R,E]
    slot_of = jnp.sum(slot, axis=-1)  # [B,S,R]
    assigned = jnp.sum(assign, axis=-1)  # [B,S,R] 0/1
    kept = assigned * (slot_of < C).astype(jnp.int32)
    return assign, slot_of, assigned, kept


def _dispatch(x, idx, slot_of, kept, E: int, C: int):
    """Dispatch by gather: [B, E, C, D], the token in slot c of expert e (an empty slot reads a zero row).
    ``token_of[b, e*C + c]`` is that token's position (S: empty). Cost O(E*C*D) per row, not the
    O(S*E*C*D) of a one-hot dispatch einsum; copies are exact."""
    B, S, Dm = x.shape
    R = idx.shape[-1]
    lin_slot = jnp.where(kept == 1, idx * C + slot_of, E * C)  # dropped -> a discarded slot

    def slots_of_row(lin_row):
        tok = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[:, None], (S, R))
        return jnp.full((E * C + 1,), S, jnp.int32).at[lin_row.reshape(-1)].set(tok.reshape(-1))[: E * C]

    token_of = jax.vmap(slots_of_row)(lin_slot)  # [B, E*C]
    x_pad = jnp.concatenate([x, jnp.zeros((B, 1, Dm), x.dtype)], axis=1)
    return jnp.take_along_axis(x_pad, token_of[..., None], axis=1).reshape(B, E, C, -1)


def _experts_exchanged(expert_in, w_in, w_out, ep: ExpertParallel, hooks: Hooks, layer: int):
    """Expert parallelism: the slots go to their experts' devices by one all-to-all (dispatch), this
    device's ``E / X`` experts compute, and the outputs come back by a second (combine). Returns
    ``(expert_out [B, E, C, D], extra)``; ``extra``: ``out_sq`` under an expert-output drift, ``sends``
    and ``recvs`` with ``hooks.probes`` (:func:`_moe`)."""
    B, E, C, Dm = expert_in.shape
    X = ep.size
    El = E // X
    extra = {}
    # [X, E/X, B, C, D]: part x holds the slots of the experts of the x-th device of the axis.
    send = jnp.transpose(expert_in.reshape(B, X, El, C, Dm), (1, 2, 0, 3, 4))
    if hooks.probes is None:
        recv = jax.lax.all_to_all(send, ep.axis, 0, 0)
    else:  # [X (source), E/X, B, C, D]
        recv = _exchange(send, hooks.probes[layer, _DISPATCH], hooks.fault,
                         hooks.hit("transit_dispatch_grad", layer), ep.axis)
    recv = _inner(recv, hooks, "transit_dispatch", layer)  # what arrived, not what was sent
    pre = _inner(_matmul("xebcd,edf->xebcf", recv, w_in, hooks, "ffn_up", layer), hooks, "ffn_up", layer)
    h = _inner(jax.nn.gelu(pre), hooks, "ffn_down", layer)
    out = _matmul("xebcf,efd->xebcd", h, w_out, hooks, "ffn_down", layer)
    out = _maybe_flip(out, hooks, "expert_forward", layer)
    if hooks.drift is not None:  # a persistent x(1 + m) drift of this device's experts (DriftSpec expert_output)
        out = hooks.drift_output(out)
        extra["out_sq"] = jnp.sum(jnp.square(out.astype(jnp.float32)))
    if hooks.probes is None:
        back = jax.lax.all_to_all(out, ep.axis, 0, 0)
    else:  # [X (owner), E/X, B, C, D]
        back = _exchange(out, hooks.probes[layer, _COMBINE], hooks.fault,
                         hooks.hit("transit_combine_grad", layer), ep.axis)
    back = _inner(back, hooks, "transit_combine", layer)
    if hooks.probes is not None:
        extra["sends"] = jnp.stack([_send_fingerprint(send), _send_fingerprint(out)])
        extra["recvs"] = jnp.stack([_part_fingerprints(recv), _part_fingerprints(back)])  # [2, X, 2]
    return jnp.transpose(back, (2, 0, 1, 3, 4)).reshape(B, E, C, Dm), extra


def _combine(expert_out, idx, slot_of, gate, kept, dtype):
    """Combine: [B, S, D], each token's R outputs gathered and summed in rank order, weighted by their
    gates. (A combine einsum over (e, c) would let the slot positions decide which accumulator lane
    each term lands in, so a token's output would change in the last bit when other tokens, e.g.
    another packed document, take other slots.)"""
    B, E, C, _ = expert_out.shape
    S, R = idx.shape[1], idx.shape[2]
    flat_out = expert_out.reshape(B, E * C, -1)
    lin = (idx * C + jnp.minimum(slot_of, C - 1)).reshape(B, S * R, 1)
    per_rank = jnp.take_along_axis(flat_out, lin, axis=1).reshape(B, S, R, -1)
    weight = (gate * kept.astype(jnp.float32)).astype(dtype)
    y = per_rank[:, :, 0] * weight[:, :, 0, None]
    for r in range(1, R):
        y = y + per_rank[:, :, r] * weight[:, :, r, None]
    return y


def _router_stats(logits, probs, assign, idx, assigned, kept, valid, cfg: ModelConfig) -> dict[str, Any]:
    """The layer's router statistics (:func:`_moe`'s ``stats`` but the exchange's)."""
    E, R = cfg.n_experts, cfg.top_k
    validf = valid.astype(jnp.float32)
    n_valid_row = jnp.maximum(jnp.sum(validf, axis=1), 1.0)  # [B]
    counts = jnp.sum(assign, axis=(1, 2)).astype(jnp.float32)  # [B, E] assignments before capacity
    f = counts / (n_valid_row[:, None] * R)
    P = jnp.sum(probs * validf[..., None], axis=1) / n_valid_row[:, None]
    lb_rows = E * jnp.sum(f * P, axis=-1) * (jnp.sum(validf, axis=1) > 0)  # [B]
    z = jax.nn.logsumexp(logits, axis=-1) ** 2  # [B, S]
    entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
    return {
        "lb_sum": jnp.sum(lb_rows),
        "z_sum": jnp.sum(z * validf),
        "entropy_sum": jnp.sum(entropy * validf),
        "tokens": jnp.sum(validf),
        "assigned": jnp.sum(counts, axis=0),  # [E]
        "dropped": jnp.sum((assigned - kept).astype(jnp.float32)),
        "max_logit": jnp.max(jnp.where(valid[..., None], logits, -jnp.inf)),
        "kept": jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32) * kept[..., None].astype(jnp.float32),
                        axis=(0, 1, 2)),  # [E]
    }


def _leaf_indices(params) -> dict[str, int]:
    return {jax.tree_util.keystr(path): i for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0])}


def forward(params, batch: Mapping[str, jnp.ndarray], cfg: ModelConfig, router_bias=None, *,
            ep: Optional[ExpertParallel] = None, hooks: Hooks = Hooks()):
    """Runs the decoder.

    Args:
      params: from :func:`init_params` (under expert parallelism, inside ``shard_map``: this
        device's expert shards).
      batch: ``inputs``, ``inputs_segmentation``, ``inputs_position``: int32 [B, S].
      router_bias: float32 [L, E], the loss-free balancing bias of each layer, or None.
      ep: expert parallelism (all-to-all dispatch inside ``shard_map``), or None (gather dispatch).
      hooks: drill faults and send fingerprints (:class:`Hooks`).

    Returns:
      ``(logits, stats)``: logits float32 [B, S, V]; stats: the :func:`_moe` figures of each
      layer stacked on a leading layer axis (float32 [L], ``assigned`` and ``kept`` [L, E],
      ``sends`` uint32 [L, 2, 2] and ``recvs`` uint32 [L, 2, X, 2] when taken).
    """
    tokens = batch["inputs"]
    seg = batch["inputs_segmentation"]
    pos = batch["inputs_position"]
    x = jnp.take(params["embed"], tokens, axis=0)
    valid = seg != 0
    index = _leaf_indices(params) if hooks.fault is not None else {}
    per_layer = []
    for i, p in enumerate(params["layers"]):
        attn = _attention(p, _rms_norm(x, p["attn_norm"]), seg, pos, cfg, hooks, i)
        x = x + _maybe_flip(attn, hooks, "attention", i)
        leaves = tuple(index.get(f"['layers'][{i}]['{w}']") for w in ("w_in", "w_out"))
        y, stats = _moe(p, _rms_norm(x, p["moe_norm"]), valid, cfg, None if router_bias is None else router_bias[i],
                        ep=ep, hooks=hooks, layer=i, leaf_index=leaves)
        x = x + y
        per_layer.append(stats)
    x = _rms_norm(x, params["final_norm"])
    logits = jnp.einsum("bsd,dv->bsv", x, params["unembed"], preferred_element_type=jnp.float32)
    return logits, jax.tree_util.tree_map(lambda *v: jnp.stack(v), *per_layer)


def local_loss(params, batch, cfg: ModelConfig, total_tokens, total_rows, router_bias=None, *,
               ep: Optional[ExpertParallel] = None, hooks: Hooks = Hooks()):
    """One device's contribution to the global loss (module docstring).

    Args:
      batch: the six int32 [B, S] arrays of :data:`BATCH_KEYS` (this device's rows).
      total_tokens: float32 scalar, target tokens (``targets_segmentation != 0``) in the
        *global* batch; clamped to >= 1.
      total_rows: float32 scalar, rows in the global batch.
      router_bias: float32 [L, E] (loss-free balancing) or None.
      ep, hooks: as :func:`forward`.

    Returns:
      ``(loss_contribution, aux)``: float32 scalar
      ``ce_sum / N + aux_w * lb_sum / (rows * L) + z_w * z_sum / (N * L)`` (``lb_sum`` and
      ``z_sum`` summed over layers), and ``aux`` with ``ce_sum`` and the per-layer
      :func:`forward` stats.
    """
    logits, stats = forward(params, batch, cfg, router_bias, ep=ep, hooks=hooks)
    logp = jax.nn.log_softmax(logits, axis=-1)
    tgt = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    ce_sum = -jnp.sum(tgt * mask)
    n = jnp.maximum(total_tokens, 1.0)
    L = float(cfg.n_layers)
    lb_sum, z_sum = stats["lb_sum"][0], stats["z_sum"][0]
    for i in range(1, cfg.n_layers):  # layer order, as a running sum
        lb_sum, z_sum = lb_sum + stats["lb_sum"][i], z_sum + stats["z_sum"][i]
    loss = (
        ce_sum / n
        + cfg.aux_loss_weight * lb_sum / (total_rows * L)
        + cfg.z_loss_weight * z_sum / (n * L)
    )
    return loss, dict(stats, ce_sum=ce_sum)


def router_bias_update(bias, assigned, rate: float):
    """Loss-free balancing update: ``bias + rate * (mean(assigned) - assigned) / mean(assigned)``.

    DeepSeek-V3 (sec. 2.1.2) moves each bias by ``rate * sign(load error)``. Here the error is taken
    in relative units instead of its sign (proportional control): measured on the reference model,
    whose router probabilities stay close to uniform early in training, sign steps of a fixed size
    flip the choice of every token at once and the load oscillates between experts from step to
    step; a step proportional to the error shrinks as the load balances.

    Args:
      bias: float32 [L, E]; assigned: float32 [L, E], the step's global assignments per expert.

    Returns:
      float32 [L, E]: an overloaded expert's bias goes down, an underloaded one's up.
    """
    mean = jnp.mean(assigned, axis=-1, keepdims=True)
    return bias + jnp.float32(rate) * (mean - assigned) / jnp.maximum(mean, 1.0)


def count_target_tokens(batch) -> jnp.ndarray:
    """float32 scalar: target tokens (``targets_segmentation != 0``) in ``batch``."""
    return jnp.sum(batch["targets_segmentation"] != 0).astype(jnp.float32)
