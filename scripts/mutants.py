"""Deliberate breaks of the code, and the tests that must fail under each (``STYLE.md``: a test that
cannot fail is worse than none).

Each entry of ``MUTATIONS`` names a file, an exact piece of its text (the anchor, found exactly
once) and what replaces it, the pytest node ids that must catch it, and why it matters. For each
one this script copies the tree (``git ls-files``: tracked files and untracked ones git does not
ignore) to a temporary directory, applies the mutation there, and runs those tests in the copy
(``pytest -x -q -p no:cacheprovider``) with ``PYTHONPATH`` set to the copy, so the copy's code is
the one imported, in the subprocesses the tests start too. It prints one line per mutation:

    caught NAME by TEST                 a test failed
    caught NAME (timeout after S s)     the tests hung past --timeout (a hang is a failure too)
    missed NAME                         every test passed
    missed NAME (anchor not found in FILE)   the code moved: update the anchor
    missed NAME (pytest exited N: ...)       the tests did not run (a node id that does not exist)

and last ``mutants: K of N caught``. It exits 0 only when every mutation was caught.

``SIM_MUTANTS`` are the simulation's own broken engines (``gradientmail_sim/mutants.py``,
patched in at run time): they run through their harness, ``tests/test_sim_mutants.py``, whose test
passes when the simulation caught the mutant, so for them a passing test is ``caught``.

    python scripts/mutants.py -j 2           every mutation (about 5 minutes on two cores)
    python scripts/mutants.py --quick -j 2   the quick subset (about a minute; scripts/test.sh runs it)
    python scripts/mutants.py --only NAME ...   --list   -j N   --timeout S   --keep
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    original: str  # exact text, found exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # pytest node ids that must fail
    why: str  # one line: what the break is, and which finding it answers
    quick: bool = False  # in the --quick subset (cheap tests only)
    sim: bool = False  # a simulation mutant run through its harness (a passing test is caught)
    env: tuple[tuple[str, str], ...] = ()  # set for its tests (a smaller simulation sweep)


def M(name: str, file: str, original: str, replacement: str, tests: str | tuple[str, ...], why: str, *, quick: bool = False, env: dict[str, str] | None = None) -> Mutation:  # fmt: skip
    tests = (tests,) if isinstance(tests, str) else tests
    return Mutation(name, file, original, replacement, tests, why, quick, env=tuple((env or {}).items()))


T_SESSION = "tests/test_sharded_session.py"
T_CLOSER = "tests/test_sharded_closer.py"
T_CARRY_RUN = (
    "tests/test_alignment.py::test_learners_with_carry_keep_the_steps_since_their_contribution_at_every_commit_of_a_run"
)
T_VERIFY = "tests/test_verify.py::"
T_MEMORY = (
    "tests/test_sharded_memory.py::test_no_rank_allocates_a_fragment_in_a_publish_or_a_commit_as_the_os_measures_it"
)

# "finding N" in a reason: the N-th finding of the review that broke the code on purpose and found
# tests passing anyway; each such test now fails under its break (and the old one did not).
# fmt: off
MUTATIONS: list[Mutation] = [
    # 1. What a sharded node uploads (every node ends on the newest commit, whatever it uploaded)
    M("sharded-delta-scaled-at-publish", "gradientmail_core/sharded/rank_io.py",
      "            d.sub_(local)  # float32(anchor)",
      "            d.sub_(local).mul_(1.5)  # float32(anchor)",
      (f"{T_SESSION}::test_a_two_rank_fsdp2_node_and_a_plain_node_train_in_lockstep_and_end_bit_identical",),
      "finding 1: each rank's delta 1.5 times anchor - local; the uploads are checked against anchor - local"),
    M("sharded-chunks-scaled-after-capture", "gradientmail_core/sharded/rank_host.py",
      '                cap = io.publish(int(a["f"]), int(a["r"]), int(a["seq"]))\n',
      '                cap = io.publish(int(a["f"]), int(a["r"]), int(a["seq"]))\n'
      "                [t.mul_(1.5) for chunk in cap.owned.values() for _, t in chunk]\n",
      (f"{T_SESSION}::test_a_two_rank_fsdp2_node_and_a_plain_node_train_in_lockstep_and_end_bit_identical",),
      "finding 1: the captured chunks scaled in the runtime (RankIO's own test never sees it)"),
    # 2. Anchors kept elsewhere than beside the parameters
    M("disk-anchors-rounded-to-bf16", "gradientmail_core/sharded/anchors.py",
      "                data = v.detach().contiguous()\n",
      "                data = v.detach().contiguous().to(torch.bfloat16).to(v.dtype)\n",
      (f"{T_CLOSER}::test_anchors_on_the_device_in_host_memory_or_on_disk_upload_and_commit_the_same_bytes",),
      "finding 2: anchors written to disk lose bits; the disk run must upload the device run's bytes"),
    M("host-and-disk-anchors-read-off-at-publish", "gradientmail_core/sharded/rank_io.py",
      "            self.anchors.load_into(f, n, d, op)\n",
      "            self.anchors.load_into(f, n, d, op)\n"
      '            if self.anchors.place != "device":\n'
      "                d.add_(1e-3)\n",
      (f"{T_CLOSER}::test_anchors_on_the_device_in_host_memory_or_on_disk_upload_and_commit_the_same_bytes",),
      "finding 2: anchors off the device read wrong at publish only; close still loads the newest commit"),
    # 3. The memory bound, measured by the OS (the Meter counts only what the code reports to it)
    M("full-fragment-gathered-at-publish", "gradientmail_core/sharded/rank_io.py",
      "        names = self.run.fragments[f]\n        op = Meter()\n        delta = {}\n",
      "        names = self.run.fragments[f]\n        op = Meter()\n        delta = {}\n"
      "        _whole = [self.sharded.params[n].full_tensor() for n in names]\n",
      (T_MEMORY,),
      "finding 3: every rank holds full_tensor() of the whole fragment during a publish, unmetered"),
    M("full-fragment-gathered-at-commit", "gradientmail_core/sharded/rank_io.py",
      "        owned, op = got\n        names = self.run.fragments[f]\n",
      "        owned, op = got\n        names = self.run.fragments[f]\n"
      "        _whole = [self.sharded.params[n].full_tensor() for n in names]\n",
      (T_MEMORY,),
      "finding 3: every rank holds full_tensor() of the whole fragment while it writes a commit, unmetered"),
    # 4. Memory a follower holds, wherever it is held
    M("follower-keeps-a-model-copy-in-a-closure", "gradientmail_core/syncer/learner.py",
      "        self.anchors[f] = c.theta\n",
      "        self.anchors[f] = c.theta\n"
      "        _keep = {n: np.array(v, copy=True) for n, v in c.theta.items()}\n"
      "        _previous = getattr(self, '_undo', dict)\n"
      "        self._undo = lambda: {**_previous(), **_keep}\n",
      ("tests/test_node_memory.py::test_follower_holds_one_copy_of_the_model_with_the_fragment_in_flight",),
      "finding 4: every commit's parameters copied into a chain of closures (an 'undo' hook)", quick=True),
    # 5. Carry (and the other runs that ended in finish + assert_identical)
    M("carry-keeps-the-steps-twice", "gradientmail_core/adapters/handles.py",
      "np.add(t, np.subtract(local[n], snapshot[n], dtype=np.float32), dtype=np.float32)",
      "np.add(t, 2 * np.subtract(local[n], snapshot[n], dtype=np.float32), dtype=np.float32)",
      (T_CARRY_RUN,),
      "finding 5: Carry adds the local steps since the snapshot twice", quick=True),
    M("carry-reports-the-kept-steps-twice", "gradientmail_core/syncer/learner.py",
      "            keep = 1.0\n",
      "            keep = 2.0\n",
      (T_CARRY_RUN,),
      "finding 5: after a Carry commit the next contribution reports its kept steps (and tokens) twice", quick=True),
    M("takeover-forgets-the-momentum", "gradientmail_core/syncer/merger.py",
      "            loaded.append(FragmentState(version, params, master, momentum, checkpoint=version))\n",
      "            momentum = {n: np.zeros_like(v) for n, v in momentum.items()}\n"
      "            loaded.append(FragmentState(version, params, master, momentum, checkpoint=version))\n",
      ("tests/test_engine_takeover.py::test_closer_that_dies_is_taken_over_when_its_lease_is_lost",),
      "finding 5: a closer that takes over starts from zero momentum (every node still ends identical)",
      quick=True),
    # 6. What an I2 run sends
    M("i2-deltas-sent-as-f32", "gradientmail_core/protocol/run.py",
      "            return dict.fromkeys(self.fragments[f], self.cfg.delta_dtype)\n",
      '            return dict.fromkeys(self.fragments[f], "F32" if self.cfg.delta_dtype == "I2" else self.cfg.delta_dtype)\n',
      ("tests/test_quant_i2.py::test_a_run_with_i2_deltas_and_commits_ends_identical_and_matches_its_digests",),
      "finding 6: every node agrees to send and read I2 deltas as F32 (the commits are still I2)", quick=True),
    # 7. The library's own sha256 check of what it reads
    M("streamed-reads-skip-the-sha256", "gradientmail_core/codec/payload.py",
      "        if self.digest is not None and self.digest.hexdigest() != self.sha256:\n",
      "        if False:\n",
      ("tests/test_s3_multipart.py::test_a_part_read_back_corrupt_is_caught_by_the_payloads_sha256",),
      "finding 7: payload reads decode bytes that do not hash to their reference", quick=True),
    # 8. Tests that could not fail
    M("record-refs-bound-off-by-one", "gradientmail_core/protocol/run.py",
      "        return n * (participants + 1) > RECORD_REFS\n",
      "        return n * participants > RECORD_REFS\n",
      ("tests/test_chunked_payloads.py::test_a_run_whose_records_would_not_fit_is_refused_at_creation",),
      "finding 8: a record between checkpoints forgets the change's refs (the old assertion was always true)",
      quick=True),
    M("refused-replay-changes-its-state", "gradientmail_core/syncer/replay.py",
      "    if differences(commit, rec, REPLAYED):\n        merger.forget(f, unless=state.version)\n",
      "    state.momentum.update(commit.state.momentum)\n"
      "    if differences(commit, rec, REPLAYED):\n        merger.forget(f, unless=state.version)\n",
      ("tests/test_checkpoint_every.py::test_a_missing_contribution_makes_the_new_closer_wait_and_a_wrong_one_is_refused",),
      "finding 8: a replay that is refused has already written its momentum into the state it started from",
      quick=True),
    M("record-fault-injection-never-fires", "tests/sharded_node.py",
      "        if key.startswith(keys.ROUNDS) and self.left > 0:\n",
      "        if key.startswith(keys.ROUNDS + 'never/') and self.left > 0:\n",
      (f"{T_CLOSER}::test_a_commit_whose_record_could_not_be_written_is_computed_again_from_the_same_state",),
      "finding 8: the record writes never fail (records written another way): the test must say so"),
    M("sim-runs-without-error-feedback", "gradientmail_sim/actors.py",
      "                self.draw.cfg,\n                sn.clock,\n",
      '                __import__("dataclasses").replace(self.draw.cfg, error_feedback=False),\n                sn.clock,\n',
      ("tests/test_sim.py::test_the_sweep_mixes_checkpoints_error_feedback_and_chunks",),
      "finding 8: the simulated nodes run without the error feedback their scenario drew",
      env={"GM_SIM_SEEDS": "40", "GM_SIM_ROUNDS": "20"}),
    M("mlx-delta-sign-flipped-in-place", "gradientmail_core/adapters/mlx.py",
      "np.subtract(o, self.read([n])[n], out=o, dtype=np.float32)",
      "np.subtract(self.read([n])[n], o, out=o, dtype=np.float32)",
      ("tests/test_quant_i2.py::test_mlx_deltas_encode_to_the_numpy_bytes",),
      "finding 8: an MLX learner's consumed delta is local - anchor (the old test compared numpy with numpy)",
      quick=True),
    M("only-ec-keys-refused", "gradientmail_core/protocol/identity.py",
      "    if not isinstance(key, ed.Ed25519PrivateKey):\n",
      '    if type(key).__name__ == "ECPrivateKey":\n',
      ("tests/test_identity.py::test_an_rsa_or_ec_key_is_refused",),
      "finding 8: an RSA identity key is taken (the 'RSA is refused' test used an EC key)", quick=True),
    # The arithmetic: merge weights, RDA, Nesterov, the quantizers' scales, error feedback
    M("merge-weight-per-step-only", "gradientmail_core/aggregators/merge.py",
      "return float(tokens) * (float(tokens) / float(steps))",
      "return float(tokens) / float(steps)",
      ("tests/test_merge.py::test_contribution_weight_is_tokens_times_tokens_per_step",),
      "a contribution weighs tokens/steps, not tokens * tokens/steps", quick=True),
    M("merge-weights-over-their-count", "gradientmail_core/aggregators/merge.py",
      "return [w / total for w in ws]",
      "return [w / len(ws) for w in ws]",
      ("tests/test_merge.py::test_weighted_mean_matches_hand_computation",),
      "the weights are divided by their number, not their sum", quick=True),
    M("rda-radius-unweighted", "gradientmail_core/aggregators/fused.py",
      "radius += p_i * n",
      "radius += n / len(xs)",
      ("tests/test_merge.py::test_rda_with_unequal_weights",),
      "RDA's length is the plain mean of the norms, not their weighted mean", quick=True),
    M("nesterov-without-look-ahead", "gradientmail_core/aggregators/outer.py",
      "np.multiply(mc, beta32, out=sc)",
      "np.multiply(mc, np.float32(0), out=sc)",
      ("tests/test_outer.py::test_nesterov_outer_step_matches_the_golden_fixture",),
      "the outer step leaves the momentum out of the update: theta - lr * d", quick=True),
    M("nesterov-momentum-never-decays", "gradientmail_core/aggregators/outer.py",
      "np.multiply(mf[s:e], beta32, out=mc)",
      "np.copyto(mc, mf[s:e])",
      ("tests/test_outer.py::test_nesterov_outer_step_matches_the_golden_fixture",),
      "the momentum is m + d, not beta * m + d", quick=True),
    M("f4-scale-one-step-coarse", "gradientmail_core/codec/quant.py",
      "k = _pow2_exponent(amax, E2M1_MAX)",
      "k = _pow2_exponent(amax, E2M1_MAX) + 1",
      ("tests/test_quant.py::test_f4_scale_per_block_is_the_smallest_power_of_two_that_fits",),
      "F4's block scale is twice the smallest power of two that fits", quick=True),
    M("f8-scale-one-step-coarse", "gradientmail_core/codec/quant.py",
      "    return k + 127\n",
      "    return k + 128\n",
      ("tests/test_quant.py::test_e4m3_scale_is_the_smallest_power_of_two_that_fits",),
      "F8's tensor scale byte is one power of two too large", quick=True),
    M("i2-scale-byte-off-by-one", "gradientmail_core/codec/quant_i2.py",
      "sc = (k + 127).astype(np.uint8)",
      "sc = (k + 128).astype(np.uint8)",
      ("tests/test_quant_i2.py::test_grid_values_are_exact_and_quantizing_twice_changes_nothing",),
      "I2's scale byte names twice the scale its codes were chosen for", quick=True),
    M("i2-scale-search-prefers-the-smaller-of-equals", "gradientmail_core/codec/quant_i2.py",
      "better = err < best_err",
      "better = err <= best_err",
      ("tests/test_quant_i2.py::test_of_equally_good_scales_the_first_tried_the_largest_is_kept",),
      "I2's scale search keeps the last (smallest) of equally good scales, not the first", quick=True),
    M("feedback-residual-sign-flipped", "gradientmail_core/adapters/feedback.py",
      "e = np.subtract(x, quant.dequantize(q), dtype=_F32)",
      "e = np.subtract(quant.dequantize(q), x, dtype=_F32)",
      ("tests/test_error_feedback.py::test_the_residual_is_the_fed_delta_minus_what_was_sent",),
      "error feedback keeps what was sent minus what was meant: the error doubles instead of cancelling",
      quick=True),
    M("feedback-added-to-the-next-delta-too", "gradientmail_core/adapters/handles.py",
      "        self.residuals.carry(fragment, left)\n",
      "        self.residuals.carry(fragment, owed)\n",
      ("tests/test_error_feedback.py::test_the_residual_is_sent_again_only_where_the_inner_steps_leave_the_parameters",),
      "issue 29: a residual given back to the parameters is also added to the next delta (the rule before): sent "
      "twice where the inner steps already bring the commit's displacement back", quick=True),
    M("feedback-not-given-back", "gradientmail_core/adapters/handles.py",
      "        if not owed:\n            return\n",
      "        if owed is not None:\n            return\n",
      ("tests/test_error_feedback.py::test_a_merged_delta_gives_its_residual_back_to_the_parameters",),
      "issue 29: error feedback that never gives the residual back: the quantization error is dropped", quick=True),
    # Verifying commits (issue 28): a verifier that compares nothing, trusts the weights it is
    # given, a follower that keeps applying a forger's commits, GC that keeps no window.
    M("verify-compares-nothing", "gradientmail_core/syncer/replay.py",
      "        if a != b:\n            out.append(name)",
      "        pass",
      (f"{T_VERIFY}test_verify_names_the_first_forged_round_and_its_closer_and_fails",
       f"{T_VERIFY}test_a_follower_with_verify_never_applies_a_forged_commit_and_reports_it_in_its_round"),
      "a recomputed commit is never compared with the record: every forgery verifies", quick=True),
    M("verify-trusts-recorded-weights", "gradientmail_core/syncer/verify.py",
      "if p.steps <= 0 or contribution_weight(p.tokens, p.steps) != p.weight:",
      "if p.steps <= 0:",
      (f"{T_VERIFY}test_inputs_that_contradict_their_record_are_a_mismatch",),
      "a closer may weigh a participant as it likes: the recomputation uses the recorded weights", quick=True),
    M("follower-keeps-following-a-forger", "gradientmail_core/syncer/follower.py",
      "        self.distrusted[rec.closer] = rec.round\n",
      "",
      (f"{T_VERIFY}test_a_follower_with_verify_never_applies_a_forged_commit_and_reports_it_in_its_round",),
      "a follower refuses the forged round but applies the forger's later commits unchecked", quick=True),
    M("gc-keeps-no-window", "gradientmail_core/syncer/gc.py",
      "        if w == 0:\n            return r + 1, r + 1, r + 1",
      "        if True:\n            return r + 1, r + 1, r + 1",
      (f"{T_VERIFY}test_an_honest_finished_run_verifies_every_round_of_its_window",),
      "garbage collection deletes what verifying the newest rounds needs: nothing is verifiable", quick=True),
    M("cli-checks-no-mac", "gradientmail_core/cli/overview.py",
      "            if auth is not None:\n                auth.verify(rec, key)",
      "            pass",
      (f"{T_VERIFY}test_read_only_commands_name_a_record_that_fails_its_mac_and_skip_it",),
      "gradientmail rounds/status show a record whose MAC fails as a commit", quick=True),
    M("canonical-names-keep-the-wrappers", "gradientmail_core/adapters/naming.py",
      "    inner = wrapped(module)\n    while inner is not None:",
      "    inner = None\n    while inner is not None:",
      ("tests/test_names.py::test_wrappers_are_removed_at_any_depth_and_a_tied_parameter_is_named_once",),
      "a compiled or DDP-wrapped model names its parameters _orig_mod./module.: its own schema, no run with others",
      quick=True),
    M("tied-parameter-travels-twice", "gradientmail_core/adapters/naming.py",
      "if p.requires_grad and id(p) not in seen:",
      "if p.requires_grad:",
      ("tests/test_names.py::test_a_tied_weight_travels_once_and_stays_one_tensor_after_every_commit",),
      "a tied weight in the schema under both names: sent twice, merged twice", quick=True),
    M("schema-mismatch-without-the-fix", "gradientmail_core/protocol/schema.py",
      "raise SchemaMismatch(diffs, fix=suggest_fix(run, mine))",
      "raise SchemaMismatch(diffs)",
      ("tests/test_names.py::test_a_plain_node_whose_names_are_one_level_deeper_is_told_to_pass_module",),
      "issue 26: a mismatch that only lists names, not the module= that fixes it", quick=True),
    M("sharded-node-skips-the-schema-check", "gradientmail_core/sharded/lead_rank.py",
      "        check_schema(manifest.schema, s.adapter.schema())",
      "        pass",
      ("tests/test_names.py::test_sharded_fsdp2_and_fsdp1_nodes_whose_names_differ_raise_schema_mismatch_with_the_fix_on_every_rank",),
      "issue 26: a sharded node of other names joins and fails later with a bare KeyError"),
    M("trainer-counts-an-overflow-step", "gradientmail_lightning/hf_trainer.py",
      "        if not overflowed(optimizer):",
      "        if True:",
      ("tests/test_hf_trainer.py::test_an_fp16_step_the_grad_scaler_skips_is_not_a_session_step",),
      "a fused optimizer's step the GradScaler skipped counts as a session step (its delta is of no step)"),
    M("reader-keeps-a-decoded-tensors-part", "gradientmail_core/codec/payload.py",
      "                del stored  # (its bytes not kept while the next tensor's arrive)\n",
      "",
      ("tests/test_payload_stream.py::test_decoding_tensors_whole_in_large_parts_lets_each_part_go",),
      "issue 25: the reader keeps a part of bytes alive while the next arrives (a follower's join +0.07x)"),
    M("gap-projection-also-pushes", "gradientmail_core/aggregators/outer.py",
      "np.clip(np.divide(dots, sq, out=np.zeros_like(dots), where=sq > 0), -1.0, 0.0)",
      "np.clip(np.divide(dots, sq, out=np.zeros_like(dots), where=sq > 0), -1.0, 1.0)",
      ("tests/test_outer.py::test_drop_pullback_takes_out_what_pulls_back_along_the_gap_per_block",),
      "issue 29: gap_projection also takes out a delta's push along the master's rounding", quick=True),
    M("gap-projection-not-applied", "gradientmail_core/syncer/passes.py",
      "        if cfg.gap_projection:\n",
      "        if False:\n",
      ("tests/test_chunk_closer.py::test_gap_projection_changes_the_commit_once_the_master_holds_rounding",),
      "issue 29: the closer ignores gap_projection (a run asking for it commits plain I2)", quick=True),
    M("cap-merges-the-highest-draws", "gradientmail_core/syncer/closing.py",
      "order = draw_order(self.state.run.manifest.run_id, c.round, reported | set(c.judged))",
      "order = draw_order(self.state.run.manifest.run_id, c.round, reported | set(c.judged))[::-1]",
      ("tests/test_max_contributions.py::test_each_round_merges_the_k_lowest_draws_of_the_reported_and_learners_stay_bit_identical",),
      "issue 27: the cap's draw is not the one every node can recompute (the auditor, verify)", quick=True),
    M("cap-keeps-an-earlier-draw", "gradientmail_core/syncer/closing.py",
      "        for lr in past:\n",
      "        for lr in past[:0]:\n",
      ("tests/test_max_contributions.py::test_a_commit_retried_after_a_failure_takes_the_draw_again",),
      "issue 27: judgements past the K-th accepted are merged (more than K contributions read and merged)",
      quick=True),
    M("cap-verify-lets-a-draw-be-skipped", "gradientmail_core/protocol/schedule.py",
      "        elif lr not in refused:\n",
      "        elif False:\n",
      ("tests/test_verify_capped.py::test_verify_names_a_closer_that_merged_others_than_the_draw_takes",
       "tests/test_verify_capped.py::test_a_follower_with_verify_refuses_a_commit_that_is_not_the_draw_and_names_its_closer"),
      "issue 39: verify and verify= pass a capped round that skipped drawn contributions (the closer chose whom to merge)",
      quick=True),
    M("adaptive-joiner-starts-on-overwrite", "gradientmail_core/syncer/learner.py",
      "self._carrying[f] = cosine is not None and cosine > rule.overwrite_below",
      "self._carrying[f] = False",
      ("tests/test_alignment.py::test_adaptive_starts_a_learner_joining_a_run_under_way_on_the_rule_its_newest_commit_implies",),
      "issue 36: a learner restarted late in a run starts on Overwrite and drops its in-flight steps to the end",
      quick=True),
    M("carry-forgets-a-contribution-landed-in-a-skipped-round", "gradientmail_core/syncer/follower.py",
      "landed=s.landed.get(f),",
      "landed=None,",
      ("tests/test_alignment.py::test_carry_keeps_only_the_steps_since_a_contribution_that_landed_in_a_round_the_node_skipped",),
      "issue 36: a node that caught up past the round that merged its delta carries that delta into the next commit again",
      quick=True),
    M("cap-roster-names-only-the-judged", "gradientmail_core/syncer/closing.py",
      "c.roster = sorted(lr for lr in order if (j := c.judged.get(lr)) is None or j.reason != IGNORED)",
      "c.roster = sorted(lr for lr in order if (j := c.judged.get(lr)) is not None and j.reason != IGNORED)",
      ("tests/test_verify_capped.py::test_a_capped_run_names_a_roster_in_each_record_and_every_round_of_its_window_verifies",
       "tests/test_max_contributions.py::test_each_round_merges_the_k_lowest_draws_of_the_reported_and_learners_stay_bit_identical"),
      "issue 39: the roster leaves out the learners not drawn (nobody can check the draw over them)", quick=True),
    M("fleet-follower-lists-the-open-rounds", "gradientmail_core/syncer/node.py",
      "round_keys = self.store.keys(keys.ROUNDS, after=keys.round_key(s.head))",
      "round_keys = [k for k in self.store.keys('', after=keys.round_key(s.head)) if k.startswith(keys.ROUNDS)]",
      ("tests/test_max_contributions.py::test_the_closer_reads_only_the_drawn_contributions_and_followers_list_neither_leases_nor_snapshots",),
      "issue 27: a fleet follower's poll returns every snapshot name (its bytes grow with the fleet)", quick=True),
    M("fleet-follower-times-out-idle", "gradientmail_core/syncer/election.py",
      "if fo.timer_from is None and s.contributed >= r:",
      "if fo.timer_from is None:",
      ("tests/test_max_contributions.py::test_a_stalled_closer_is_taken_over_by_timeout_counted_from_the_followers_own_contribution",),
      "issue 27: an idle fleet's followers take the round over one after another", quick=True),
    # A node closing its session and a round it has no part in (the clean leaver's next round)
    M("settling-follower-takes-over-any-round", "gradientmail_core/syncer/election.py",
      "        if self.bridge.settling and s.contributed < r:\n",
      "        if False:\n",
      ("tests/test_engine_takeover.py::test_a_settling_follower_leaves_the_round_to_a_node_that_stays",),
      "issue 35: a follower leaving takes over a round it has no part in and loads its outer state",
      quick=True),
    M("round-without-contributions-taken-over", "gradientmail_core/syncer/election.py",
      "            if not s.snapshot_keys.get(r) and s.contributed < r:\n",
      "            if False:\n",
      ("tests/test_engine_takeover.py::test_a_clean_leavers_round_is_taken_over_only_once_it_has_a_contribution",),
      "issue 35: the round a clean leaver claimed is taken over before anyone contributed (the outer state loaded for nothing)",
      quick=True),
    # A round record damaged in the store after it landed (issue 36)
    M("own-records-never-read-back", "gradientmail_core/syncer/node.py",
      "            self.closing.recheck()  # this node's own records, read back when due\n",
      "",
      ("tests/test_damaged_record.py::test_the_writer_reads_its_record_back_and_writes_it_again_and_the_run_goes_on",),
      "issue 36: a truncated round record hangs every follower (the writer never reads it back)", quick=True),
    M("stuck-on-a-damaged-record-forever", "gradientmail_core/syncer/follower.py",
      "        if waited < self.damaged_after:\n",
      "        if True:\n",
      ("tests/test_damaged_record.py::test_without_its_writer_every_follower_stops_within_the_bound_naming_the_key_and_the_remedy",),
      "issue 36: with its writer gone, a damaged record leaves the followers polling it forever, with no error",
      quick=True),
]
# fmt: on

# The simulation's mutants (gradientmail_sim/mutants.py): name, in the --quick subset.
SIM_MUTANTS: list[tuple[str, bool]] = [
    # (the whole harness runs in the test suite already: --quick keeps two of the fast ones)
    ("skip_readback", False),
    ("accept_stale", False),
    ("sweep_newest", False),
    ("no_claim_next", False),
    ("remote_clock_lease", False),
    ("skip_sha_check", False),
    ("count_twice", True),
    ("stale_view_is_fatal", False),
    ("gc_forgets_checkpoints", False),
    ("gc_ignores_window", False),
    ("replay_skips_contribution", False),
    ("weights_not_normalised", False),
    ("rda_length_unweighted", False),
    ("nesterov_without_momentum", False),
    ("outer_lr_twice", True),
    ("pullback_also_pushes", False),
]


def sim_mutations() -> list[Mutation]:
    return [
        Mutation(
            f"sim:{name}",
            "gradientmail_sim/mutants.py",
            "",
            "",
            (f"tests/test_sim_mutants.py::test_mutant_is_caught[{name}]",),
            "a broken engine the simulation must catch (its harness test passes when it does)",
            quick,
            sim=True,
        )
        for name, quick in SIM_MUTANTS
    ]


def everything() -> list[Mutation]:
    return MUTATIONS + sim_mutations()


# ---- one mutation --------------------------------------------------------------------------------


def tree_files(root: Path) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.decode()
    return sorted({p for p in out.split("\0") if p})


def copy_tree(root: Path, files: list[str], dest: Path) -> None:
    for rel in files:
        src = root / rel
        if not src.is_file() and not src.is_symlink():
            continue  # deleted in the working tree, still in the index
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target, follow_symlinks=False)


def apply(m: Mutation, copy: Path) -> str | None:
    """Applies ``m`` in ``copy``; the reason it cannot be applied, or None."""
    if m.sim:
        return None
    path = copy / m.file
    if not path.is_file():
        return f"no file {m.file}"
    text = path.read_text()
    found = text.count(m.original)
    if found == 0:
        return f"anchor not found in {m.file}"
    if found > 1:
        return f"anchor found {found} times in {m.file}"
    text = text.replace(m.original, m.replacement)
    if m.file.endswith(".py"):
        try:
            compile(text, m.file, "exec")
        except SyntaxError as e:
            return f"the mutated {m.file} does not compile: {e}"
    path.write_text(text)
    return None


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _kill_all(proc: subprocess.Popen[bytes]) -> None:
    # Tests start process groups of their own (torchrun): every descendant, then the group.
    for pid in _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


@dataclass
class Outcome:
    mutation: Mutation
    caught: bool
    line: str
    seconds: float
    log: str = ""


def pytest_run(m: Mutation, copy: Path, timeout: float, python: str) -> tuple[int | None, str]:
    """(pytest's exit status, None on timeout; its output)."""
    env = {**os.environ, **dict(m.env), "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", *m.tests]
    log = copy / ".mutant-pytest.log"
    with open(log, "wb") as sink:  # a file, not a pipe: nothing blocks on a full pipe
        proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_all(proc)
            status = None
    return status, log.read_text(errors="replace")


def first_failure(output: str) -> str | None:
    for line in output.splitlines():
        hit = re.match(r"(?:FAILED|ERROR) (\S+)", line)
        if hit:
            return hit.group(1)
    return None


def run_one(m: Mutation, files: list[str], timeout: float, python: str, keep: bool) -> Outcome:
    t0 = time.monotonic()
    copy = Path(tempfile.mkdtemp(prefix=f"gm-mutant-{re.sub(r'[^A-Za-z0-9_.-]', '_', m.name)}-"))
    try:
        copy_tree(ROOT, files, copy)
        problem = apply(m, copy)
        if problem is not None:
            return Outcome(m, False, f"missed {m.name} ({problem})", time.monotonic() - t0)
        status, output = pytest_run(m, copy, timeout, python)
        seconds = time.monotonic() - t0
        if status is None:
            return Outcome(m, True, f"caught {m.name} (timeout after {timeout:.0f} s)", seconds, output)
        if m.sim:  # the harness passes when the simulation caught the mutant
            if status == 0:
                return Outcome(m, True, f"caught {m.name} by {m.tests[0]}", seconds, output)
            return Outcome(m, False, f"missed {m.name} (its harness test exited {status})", seconds, output)
        if status == 1:
            return Outcome(m, True, f"caught {m.name} by {first_failure(output) or 'the tests'}", seconds, output)
        if status == 0:
            return Outcome(m, False, f"missed {m.name}", seconds, output)
        # 2 interrupted, 3 internal error, 4 usage error (a node id that does not exist), 5 nothing collected
        return Outcome(m, False, f"missed {m.name} (pytest exited {status}: the tests did not run)", seconds, output)
    finally:
        if keep:
            print(f"  (kept {copy})", file=sys.stderr)
        else:
            shutil.rmtree(copy, ignore_errors=True)


# ---- the command -----------------------------------------------------------------------------------


def select(args: argparse.Namespace) -> list[Mutation]:
    table = everything()
    if args.only:
        names = {m.name for m in table}
        unknown = [n for n in args.only if n not in names]
        if unknown:
            raise SystemExit(f"unknown mutation(s): {', '.join(unknown)}; --list shows them")
        return [m for m in table if m.name in args.only]
    return [m for m in table if m.quick] if args.quick else table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="only the quick subset (CI)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these mutations")
    ap.add_argument("--list", action="store_true", help="print the mutations and their tests, run nothing")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="mutations run at once (default 1)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a mutation's tests may take (default 600)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest (default: this one)")
    ap.add_argument("--keep", action="store_true", help="keep the mutated copies (their paths go to stderr)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the pytest output of every missed mutation")
    args = ap.parse_args(argv)
    chosen = select(args)
    if args.list:
        for m in chosen:
            flags = " [quick]" if m.quick else ""
            print(f"{m.name}{flags}: {m.why}\n    {m.file}\n    " + "\n    ".join(m.tests))
        return 0
    files = tree_files(ROOT)
    t0 = time.monotonic()
    caught = 0
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        futures = [pool.submit(run_one, m, files, args.timeout, args.python, args.keep) for m in chosen]
        for fut in futures:  # in table order, each as soon as it (and those before it) is done
            out = fut.result()
            caught += out.caught
            print(out.line, flush=True)
            if args.verbose and not out.caught and out.log:
                print("    " + "\n    ".join(out.log.splitlines()[-30:]), flush=True)
    print(f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    print(f"mutants: {caught} of {len(chosen)} caught")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
