"""Localization through the all-to-alls (``replay.verify.localize``) and the log records of expert
parallelism: pure functions on hand-made fingerprints, no JAX."""

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from replay.run.protocol import (
    ExpertLoad,
    StepFingerprints,
    StepSignals,
    parse_send_site,
    send_site,
    send_sites_in_program_order,
)
from replay.screen.screening import expert_load_ratio
from replay.verify import compare, localize
from replay.verify.verdict import Cause, DivergenceKind, Evidence, ReplayOutcome, decide
from replay.run.codes import Verdict

SITES = send_sites_in_program_order(2)
DEVICES = range(8)


def step(sends=None, leaves=None, sites=SITES):
    """A step's fingerprints: every device sent value 1 at each site and has gradient fingerprint 1,
    except where ``sends`` ({device: {site: value}}) and ``leaves`` ({device: {leaf: value}}) say."""
    sends, leaves = sends or {}, leaves or {}
    return StepFingerprints(
        step=7, loss_bits=1, grad_norm_bits=2, batch_hash="ab", leaves={"w": {"fp": 1, "nan": 0, "inf": 0}},
        devices={d: {"w": 1, "v": 1, **leaves.get(d, {})} for d in DEVICES},
        device_coords={d: {"data": d // 4, "expert": d % 4} for d in DEVICES},
        send_sites=tuple(sites), sends={d: tuple(sends.get(d, {}).get(s, 1) for s in sites) for d in DEVICES})


def test_send_site_names_and_program_order():
    assert SITES == ("layer0.dispatch.forward", "layer0.combine.forward", "layer1.dispatch.forward",
                     "layer1.combine.forward", "layer1.combine.backward", "layer1.dispatch.backward",
                     "layer0.combine.backward", "layer0.dispatch.backward")
    assert parse_send_site(send_site(3, "combine", "backward")) == (3, "combine", "backward")
    for bad in ("layer.dispatch.forward", "layer1.gather.forward", "layer1.dispatch", "x"):
        with pytest.raises(ValueError, match="not a send site"):
            parse_send_site(bad)
    with pytest.raises(ValueError):
        send_site(-1, "dispatch", "forward")


def test_first_divergent_buffer_in_program_order_names_its_producer():
    # device 5's experts computed wrong outputs in layer 0: its combine send differs first; the
    # devices of its group (4-7) then send different tokens in layer 1 and different cotangents
    # back, and every one of their gradients differs
    later = {s: 9 for s in SITES[2:]}
    logged = step(sends={5: {SITES[1]: 9, **later}, 4: later, 6: later, 7: later},
                  leaves={d: {"w": 9} for d in (4, 5, 6, 7)})
    pairing = {d: d for d in DEVICES}
    diff = compare.compare_step(logged, step(), pairing)
    assert diff.localization.site == "layer0.combine.forward" and diff.suspects == (5,)
    assert diff.localization.reached == (4, 5, 6, 7) and diff.kind is DivergenceKind.DEVICE
    div = diff.divergence()
    assert div.devices == (5,) and div.site == "layer0.combine.forward"
    assert div.site_label == "the combine all-to-all of layer 0 (forward pass)"
    outcome = ReplayOutcome(tuple(DEVICES), Evidence.BIT_EXACT, div, "sig")
    dec = decide([outcome, ReplayOutcome(tuple(reversed(DEVICES)), Evidence.PER_SHARD, div, "sig")], 8)
    assert dec.verdict is Verdict.CONVICTED and dec.devices == (5,) and dec.site == "layer0.combine.forward"
    assert "combine all-to-all of layer 0" in dec.explanation and "[4, 6, 7] only through" in dec.explanation
    assert json.dumps(diff.to_dict())  # the step's report is JSON


def test_backward_sites_run_from_the_last_layer_down():
    # layer 1's transposed combine runs before layer 0's: device 2 there, device 0 later
    logged = step(sends={0: {"layer0.dispatch.backward": 9}, 2: {"layer1.combine.backward": 9}})
    loc = localize.localize(logged, localize.send_differences(logged, step(), {d: d for d in DEVICES}), {})
    assert loc.site == "layer1.combine.backward" and loc.producers == (2,) and loc.reached == (0, 2)
    assert loc.parts == (1, "combine", "backward") and loc.layer == 1


def test_a_gradient_no_all_to_all_carries_is_localized_to_its_device():
    logged = step(leaves={3: {"['layers'][1]['w_in']": 5}})
    diff = compare.compare_step(logged, step(), {d: d for d in DEVICES})
    loc = diff.localization
    assert loc.site == localize.LOCAL_GRADIENT and loc.producers == (3,) and loc.leaves == ("['layers'][1]['w_in']",)
    assert loc.layer == 1 and "no all-to-all carries" in loc.label()
    assert localize.describe_site("local_gradient", loc.leaves)["layer"] == 1


def test_two_producers_at_the_first_site_are_both_named_never_one():
    logged = step(sends={1: {SITES[0]: 9}, 6: {SITES[0]: 9}})
    diff = compare.compare_step(logged, step(), {d: d for d in DEVICES})
    assert diff.suspects == (1, 6)


def test_every_device_sending_wrong_at_the_first_site_is_unlocalized():
    logged = step(sends={d: {SITES[0]: 9} for d in DEVICES})
    diff = compare.compare_step(logged, step(), {d: d for d in DEVICES})
    assert diff.kind is DivergenceKind.ALL_DEVICES
    dec = decide([ReplayOutcome(tuple(DEVICES), Evidence.BIT_EXACT, diff.divergence(), "s"),
                  ReplayOutcome(tuple(reversed(DEVICES)), Evidence.PER_SHARD, diff.divergence(), "s")], 8)
    assert dec.verdict is Verdict.AMBIGUOUS and dec.cause is Cause.UNLOCALIZED


def test_sends_pair_by_mesh_position():
    # replay devices sit at other positions: device 3's position holds replay device 11
    logged = step(sends={3: {SITES[4]: 9}})
    replayed = step()
    pairing = {d: d + 8 for d in DEVICES}
    replayed = StepFingerprints(**{**replayed.__dict__, "devices": {d + 8: v for d, v in replayed.devices.items()},
                                   "sends": {d + 8: v for d, v in replayed.sends.items()}})
    assert localize.send_differences(logged, replayed, pairing) == {3: (SITES[4],)}


def test_sends_of_other_sites_or_none_are_not_compared():
    assert localize.send_differences(step(), step(sites=SITES[:4]), {d: d for d in DEVICES}) == {}
    gather = StepFingerprints(step=7, loss_bits=1, grad_norm_bits=2, batch_hash="ab", leaves={}, devices={0: {"w": 9}})
    diff = compare.compare_step(gather, StepFingerprints(**{**gather.__dict__, "devices": {0: {"w": 1}}}), {0: 0})
    assert diff.localization is None and diff.suspects == (0,)  # a gather run: as before


def test_fingerprint_lines_carry_sends_only_under_expert_parallelism():
    fp = step(sends={2: {SITES[3]: 2 ** 64 - 1}})
    back = StepFingerprints.from_json(fp.to_json())
    assert back == fp and back.sends[2][3] == 2 ** 64 - 1 and back.bits_equal(fp)
    plain = StepFingerprints(step=1, loss_bits=1, grad_norm_bits=2, batch_hash="ab", leaves={}, devices={})
    assert "sends" not in plain.to_dict() and "send_sites" not in plain.to_dict()
    assert not fp.bits_equal(step())


def test_expert_load_record():
    load = ExpertLoad.from_counts({0: 10, 1: 30, 2: 20, 3: 20})
    assert load.max_over_mean == pytest.approx(1.5)
    assert ExpertLoad.from_counts({0: 0, 1: 0}).max_over_mean == 0.0
    sig = StepSignals(step=3, loss=1.0, grad_norm=2.0, expert_load=(load,))
    back = StepSignals.from_dict(json.loads(sig.to_json()))
    assert back.expert_load == (load,)
    assert "expert_load" not in StepSignals(step=3, loss=1.0, grad_norm=2.0).to_dict()


@given(st.lists(st.lists(st.integers(0, 1000), min_size=4, max_size=4), min_size=1, max_size=6),
       st.integers(1, 50))
def test_expert_load_ratio_properties(rows, scale):
    counts = np.asarray(rows, np.float64)
    ratio, top = expert_load_ratio(counts)
    mean = counts.mean(axis=0)
    if mean.sum() == 0:
        assert (ratio, top) == (0.0, -1)
        return
    assert ratio >= 1.0 - 1e-12 and mean[top] == mean.max()
    assert ratio == pytest.approx(mean.max() / mean.mean())
    assert expert_load_ratio(counts * scale)[0] == pytest.approx(ratio)  # counts, not units
    assert expert_load_ratio(np.full((3, 4), 7.0)) == (1.0, 0)


def _with_recvs(fp, bad=None):
    """``fp`` with receive fingerprints: every part of every site 1, except ``bad`` ({device: {site: {part: v}}})."""
    import dataclasses

    bad = bad or {}
    recvs = {d: tuple(tuple(bad.get(d, {}).get(s, {}).get(p, 1) for p in range(4)) for s in fp.send_sites)
             for d in DEVICES}
    return dataclasses.replace(fp, recvs=recvs)


def test_sent_right_and_received_wrong_names_the_link_and_neither_chip():
    # device 6 (data 1, expert 2) received part 3 of layer 1's combine wrong: device 7 (data 1, expert 3) sent it
    # right. Device 6's later sends and its gradient differ, but the first divergent thing is what it received.
    later = {s: 9 for s in SITES[4:]}
    logged = _with_recvs(step(sends={6: later}, leaves={6: {"w": 9}}), {6: {SITES[3]: {3: 5}}})
    diff = compare.compare_step(logged, _with_recvs(step()), {d: d for d in DEVICES})
    loc = diff.localization
    assert loc.finding == "link" and loc.links == ((7, 6),) and loc.producers == () and loc.site == SITES[3]
    assert diff.kind is DivergenceKind.LINK and diff.suspects == ()
    assert "7 -> 6" in loc.label() and loc.to_dict()["links"] == [[7, 6]]
    out = [ReplayOutcome((0,) * 8, Evidence.BIT_EXACT, diff.divergence(), "s"),
           ReplayOutcome((1,) * 8, Evidence.PER_SHARD, diff.divergence(), "s")]
    d = decide(out, 8)
    assert d.verdict is Verdict.CONVICTED and d.cause is Cause.LINK_FAULT and d.devices == () and d.links == ((7, 6),)
    assert decide(out[:1], 8).cause is Cause.TOO_FEW_REPLAYS  # one replay convicts no link either
    # received right, sent wrong: the sender computed wrong (its send differs at the site, before any receive)
    logged = _with_recvs(step(sends={7: {SITES[3]: 9, **later}}), {6: {SITES[3]: {3: 5}}})
    loc = compare.compare_step(logged, _with_recvs(step()), {d: d for d in DEVICES}).localization
    assert loc.finding == "sent" and loc.producers == (7,) and not loc.links
    # a log without receive fingerprints names the receiver at its next send, as before
    loc = compare.compare_step(step(sends={6: later}), step(), {d: d for d in DEVICES}).localization
    assert loc.finding == "sent" and loc.producers == (6,) and loc.site == SITES[4]
    rt = StepFingerprints.from_json(logged.to_json())
    assert rt.recvs == logged.recvs and rt.bits_equal(logged)
