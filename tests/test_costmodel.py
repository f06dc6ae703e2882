"""The auto-γ cost model: what a round costs, credited to what ran, by context; choosing γ (0 = plain).

Timings are synthetic (injected cost models, or a fake clock that a slow draft advances): no test
asserts anything about this machine's wall-clock speed.
"""
import time

import numpy as np
import pytest

import edgespec
from edgespec import cli
from edgespec.costmodel import AcceptanceEstimator, CostModel, expected_tokens, monotone
from edgespec.drafts import DraftModel, Drafter, LookupDraft, Proposal
from edgespec.generate import Generator, Stats

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


# -- the formula ---------------------------------------------------------------------------------------
def test_cost_model_formula():
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    cm = CostModel([1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.6], t_draft=0.05)
    assert cm.best_gamma(0.95) >= 6 and cm.best_gamma(0.05) == 0
    assert cm.predicted_speedup(0.8, 4) == pytest.approx(expected_tokens(0.8, 4) / (4 * 0.05 + 1.2))
    est = AcceptanceEstimator(prior_accept=0, prior_reject=0, decay=1.0)
    est.update(3, 4)  # 3 accepted, then one rejection
    est.update(4, 4)  # all accepted: no failure observed
    assert est.alpha == pytest.approx(7 / 8)


def test_round_time_counts_host_and_per_round_draft_costs():
    cm = CostModel([1.0, 1.5, 2.0], t_draft=0.1, t_round=0.2, t_draft_round=0.05)
    assert cm.round_s(0) == pytest.approx(0.2 + 1.0)  # plain decoding pays the host's part too
    assert cm.round_s(2) == pytest.approx(0.2 + 0.05 + 2 * 0.1 + 2.0)
    # a drafter that proposes 1 of 2 half the time: half the rounds verify S = 2 with one proposal
    assert cm.round_s(2, counts=np.array([0.0, 0.5, 0.5])) == pytest.approx(
        0.2 + 0.05 + 0.5 * (0.1 + 1.5) + 0.5 * (0.2 + 2.0))


def test_bad_cost_models_are_refused():
    with pytest.raises(ValueError, match="t_verify must be positive"):
        CostModel([1.0, 0.0], t_draft=0.1)
    with pytest.raises(ValueError, match="one row of timings per context"):
        CostModel([[1.0, 2.0]], t_draft=0.1, contexts=(64, 256))
    with pytest.raises(ValueError, match="ascending"):
        CostModel([[1.0], [2.0]], t_draft=0.1, contexts=(256, 64))
    with pytest.raises(ValueError, match="asked 2, proposed 3"):
        CostModel([1.0] * 3, t_draft=0.1).observe(2, 3, 0.1, 0.1)


def test_monotone_fit_of_verify_costs():
    assert monotone([1.0, 1.2, 1.1, 1.3]).tolist() == pytest.approx([1.0, 1.15, 1.15, 1.3])
    assert monotone([3.0, 1.0]).tolist() == [2.0, 2.0]


# -- crediting what ran ------------------------------------------------------------------------------
def test_a_round_is_credited_to_the_verify_call_it_made():
    """A round that asked for γ = 5 but got 2 proposals verified S = 3 tokens: its time goes to t_verify(3),
    never to t_verify(6); its draft time is split over the 2 proposals it made."""
    cm = CostModel([1.0] * 6, t_draft=0.1)
    for _ in range(200):
        cm.observe(5, 2, draft_s=2 * 0.3, verify_s=2.0)
    assert cm.verify_s(3) == pytest.approx(2.0, rel=1e-3)
    assert cm.verify_s(6) == 1.0 and cm.verify_s(1) == 1.0
    assert cm.t_draft == pytest.approx(0.3, rel=1e-3)


def test_a_draft_run_that_found_nothing_teaches_the_per_round_cost():
    cm = CostModel([1.0] * 6, t_draft=0.0, t_draft_round=0.01, t_round=0.0)
    for _ in range(200):
        cm.observe(4, 0, draft_s=0.02, verify_s=1.0, host_s=0.3)  # an n-gram miss: S = 1 was verified
    assert cm.t_draft_round == pytest.approx(0.02, rel=1e-3) and cm.t_draft == 0.0
    assert cm.t_round == pytest.approx(0.3, rel=1e-3) and cm.verify_s(5) == 1.0


def test_one_slow_outlier_moves_the_model_little():
    cm = CostModel([1.0] * 3, t_draft=0.1)
    cm.observe(2, 2, draft_s=0.2, verify_s=1000.0)  # a descheduled round
    assert cm.verify_s(3) <= 1.0 + 0.1 * 2.0 + 1e-9


def test_fill_rate_of_a_drafter_that_proposes_fewer_than_asked():
    """An n-gram draft asked for 5 that proposes 2 (both kept) yields 3 tokens a round, and a round costs
    what 2 proposals cost: asking for 5 is worth no more than asking for 2."""
    est = AcceptanceEstimator(decay=1.0)
    for _ in range(200):
        est.update(2, 2, asked=5)
    p = est.proposal_counts(5)
    assert p.sum() == pytest.approx(1.0) and p[2] > 0.99
    assert est.expected_tokens(5) == pytest.approx(3.0, rel=0.02)
    cm = CostModel([1.0, 1.1, 1.2, 1.3, 1.4, 1.5], t_draft=0.01)
    assert cm.round_s(5, counts=p) == pytest.approx(cm.round_s(2), rel=0.01)
    assert cm.rate(est.alpha, 5, est.expected_tokens(5), counts=p) == pytest.approx(
        cm.rate(est.alpha, 2, est.expected_tokens(2)), rel=0.02)
    for context in (None, 64):  # best_gamma (vectorised) picks the argmax of the one-γ-at-a-time rates
        one = [cm.rate(est.alpha, g, est.expected_tokens(g), context, est.proposal_counts(g)) for g in range(6)]
        assert cm.best_gamma(est.alpha, context=context, estimator=est) == int(np.argmax(one))


def test_positionwise_acceptance_sees_bursty_drafts():
    """Rounds that either reject at once or accept all 6: pooled α is 6/7, but a_1 = 0.5 and a_2..a_6 = 1,
    so a round yields 1 + 6 * 0.5 = 4 tokens, not the 4.62 of the i.i.d. formula."""
    est = AcceptanceEstimator(prior_accept=0, prior_reject=0, decay=1.0)
    for _ in range(50):
        est.update(0, 6)
        est.update(6, 6)
    assert est.alpha == pytest.approx(6 / 7)
    e6 = est.expected_tokens(6)
    assert e6 == pytest.approx(1 + 6 * 0.5, rel=0.05)  # a_1 = 0.5, then every later draft is kept
    assert expected_tokens(est.alpha, 6) == pytest.approx(4.62, abs=0.01)
    assert est.expected_tokens(1) == pytest.approx(1.5, rel=0.05)


class TwoOfGamma(Drafter):
    """Proposes at most 2 tokens whatever γ asks, copied from a perfect draft model."""

    def __init__(self, dm: DraftModel):
        self.dm = dm

    def propose(self, contexts, gamma, pick, active):
        p = self.dm.propose(contexts, min(gamma, 2), pick, active)
        tokens = np.zeros((len(contexts), gamma), np.int64)
        tokens[:, :p.tokens.shape[1]] = p.tokens
        return Proposal(tokens, p.counts, None)

    def draft(self, ctx, gamma, out):
        return self.dm.draft(ctx, min(gamma, 2), out)

    def commit(self, accepted):
        self.dm.commit(accepted)

    def reset(self, b):
        self.dm.reset(b)


def test_generator_credits_the_proposals_a_round_really_made(tiny_engines):
    """γ = 5 is asked for (cheap long verifies) but the drafter proposes 2: the generator reports (5, 2) to
    the cost model, and only t_verify(3) learns from the rounds, never t_verify(6)."""
    same = edgespec.load(tiny_engines["same"])
    gen = Generator(same.target, "custom", same.target, same.tok, "auto",
                    drafter_factory=lambda b: TwoOfGamma(DraftModel(gen._decoder(same.target, b))))
    gen.cost = CostModel([1.0, 1.01, 1.02, 1.03, 1.04, 1.05], t_draft=1e-3, t_round=0.0)
    seen = []
    observe = gen.cost.observe
    gen.cost.observe = lambda asked, proposed, *a, **k: (seen.append((asked, proposed)), observe(asked, proposed, *a, **k))
    out = gen.generate(PROMPT, max_new_tokens=40)
    assert out.stats.drafted > 0 and max(out.stats.histogram[3:] or [0]) == 0  # never more than 2 drafts
    assert (5, 2) in seen and all(p <= 2 for _, p in seen)
    assert gen.cost.verify[0, 5] == 1.05  # S = 6 never ran, so it kept its measured value
    assert gen.cost.verify[0, 2] != 1.02  # S = 3 ran, and learned from it


# -- context buckets ---------------------------------------------------------------------------------
def test_verify_cost_is_interpolated_in_the_context_length():
    cm = CostModel([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]], t_draft=[0.1, 0.2, 0.4], contexts=(64, 256, 1024))
    assert cm.verify_s(1, 10) == 1.0 and cm.verify_s(1, 64) == 1.0
    assert cm.verify_s(1, 160) == pytest.approx(1.5) and cm.verify_s(2, 640) == pytest.approx(3.0)
    assert cm.verify_s(1, 1024 + 768) == pytest.approx(6.0)  # past the last bucket: along the last two
    assert cm.draft_s(160) == pytest.approx(0.15)
    cm.observe(1, 1, draft_s=0.15, verify_s=2.5, context=160)  # S = 2 took 1.0 more than predicted (1.5)
    assert cm.verify[:, 1].tolist() == pytest.approx([1.05, 2.05, 4.0])  # both neighbours move, halfway each


def test_auto_gamma_follows_the_context_length(tiny_engines):
    """Long verify calls are cheap at a short context and dear at a long one: auto speculates while the
    context is short and stops once it is long (a perfect draft, so only the cost changes)."""
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["same"], gamma=3)
    short, long_ = [1.0] * 9, [1.0] + [50.0] * 8
    gen.cost = CostModel([short, long_], t_draft=0.01, contexts=(40, 100))
    gen.refine_costs = False
    out = gen.generate(list(np.resize(PROMPT, 30)), max_new_tokens=90, gamma="auto")
    ctx = [30 + n for n, _ in out.stats.gamma_history]
    gammas = [g for _, g in out.stats.gamma_history]
    assert all(g >= 4 for c, g in zip(ctx, gammas) if c <= 45)
    assert all(g <= 1 for c, g in zip(ctx, gammas) if c >= 95) and any(c >= 95 for c in ctx)


def test_measured_cost_model_is_sane(tiny_engines):
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"])
    cm = gen.measure_costs(budget_s=0.0)
    cap = gen.target.manifest.max_context
    assert cm.contexts.tolist() == [64, cap - gen.gamma_max - 2]  # 64, then 256 and 1024 capped
    assert cm.verify.shape == (2, 9) and (cm.verify > 0).all() and (np.diff(cm.verify, axis=1) >= 0).all()
    assert (cm.draft > 0).all() and cm.t_round > 0
    ng = edgespec.load(tiny_engines["target"], draft="ngram").cost
    assert ng.t_draft_round > 0  # a lookup costs per round, whatever it proposes


# -- choosing γ ----------------------------------------------------------------------------------------
def test_auto_gamma_follows_acceptance_and_cost(tiny_engines):
    """With a cheap perfect draft auto climbs to long drafts; with a costly draft it stops speculating.
    Costs are injected so the test does not depend on this machine's timings."""
    good = edgespec.load(tiny_engines["target"], draft=tiny_engines["same"])
    good.cost = CostModel([1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4], t_draft=0.05)
    good.refine_costs = False
    out = good.generate(PROMPT, max_new_tokens=80)
    assert max(g for _, g in out.stats.gamma_history) == 8 and out.stats.acceptance_rate == 1.0
    costly = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"])
    costly.cost = CostModel([1.0] * 9, t_draft=0.9)  # a draft nearly as slow as the target never pays
    costly.refine_costs = False
    out = costly.generate(PROMPT, max_new_tokens=40)
    gammas = [g for _, g in out.stats.gamma_history]
    assert gammas.count(0) >= 0.8 * len(gammas) and set(gammas) <= {0, 1}  # 1 = the periodic probe


class FakeClock:
    """time.perf_counter plus a skew that a slow draft advances instead of sleeping."""

    def __init__(self):
        self.real, self.skew = time.perf_counter, 0.0

    def __call__(self):
        return self.real() + self.skew


def test_a_draft_as_slow_as_the_target_means_plain_decoding(tiny_engines, monkeypatch):
    """A perfect draft (the target itself) whose every proposal takes as long as several target calls:
    the load-time measurement sees it, and auto decodes plainly (γ = 0 but for the periodic probe)."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)

    class SlowDraft(DraftModel):
        def draft(self, ctx, gamma, out):
            c = super().draft(ctx, gamma, out)
            clock.skew += 0.05 * c  # 50 ms a proposal (a tiny target call is well under 1 ms)
            return c

        def propose(self, contexts, gamma, pick, active):
            p = super().propose(contexts, gamma, pick, active)
            clock.skew += 0.05 * int(p.counts.max(initial=0))
            return p

    same = edgespec.load(tiny_engines["same"])
    gen = Generator(same.target, "custom", same.target, same.tok, "auto",
                    drafter_factory=lambda b: SlowDraft(gen._decoder(same.target, b)))
    cm = gen.measure_costs(budget_s=0.0)
    assert cm.t_draft >= 0.04
    plain = same.generate(PROMPT, max_new_tokens=48, gamma=0)
    out = gen.generate(PROMPT, max_new_tokens=48)
    assert out.token_ids == plain.token_ids
    gammas = [g for _, g in out.stats.gamma_history]
    assert set(gammas) <= {0, 1} and gammas.count(0) >= 0.8 * len(gammas)
    assert out.stats.acceptance_rate == 1.0  # it was the cost, not the acceptance


# -- gamma_max -------------------------------------------------------------------------------------------
def test_gamma_max_16_end_to_end(tiny_engines, tmp_path, capsys):
    plain = edgespec.load(tiny_engines["target"]).generate(PROMPT, max_new_tokens=60).token_ids
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["same"], gamma=16, gamma_max=16)
    out = gen.generate(PROMPT, max_new_tokens=60)
    assert out.token_ids == plain and out.stats.histogram[16] >= 1 and len(out.stats.tried_by_position) == 16
    auto = edgespec.load(tiny_engines["target"], draft=tiny_engines["same"], gamma_max=16)
    assert auto.cost.gamma_max == 16 and auto.cost.verify.shape[1] == 17
    auto.cost = CostModel([1.0 + 0.01 * s for s in range(17)], t_draft=0.01)
    auto.refine_costs = False
    out = auto.generate(PROMPT, max_new_tokens=60)
    assert out.token_ids == plain and max(g for _, g in out.stats.gamma_history) == 16
    assert cli.main(["generate", "--target", str(tiny_engines["target"]), "--draft", str(tiny_engines["same"]),
                     "--gamma", "16", "--gamma-max", "16", "--prompt", "abcabc", "--max-new-tokens", "40",
                     "--json"]) == 0
    assert '"histogram"' in capsys.readouterr().out


def test_gamma_max_out_of_range_is_refused(tiny_engines):
    for bad in (0, 17, 2.5, True):
        with pytest.raises(ValueError, match=r"gamma_max .*integer in \[1, 16\], got"):
            edgespec.load(tiny_engines["target"], draft="ngram", gamma=2, gamma_max=bad)
    with pytest.raises(ValueError, match="gamma_max 8: raise it"):
        edgespec.load(tiny_engines["target"], draft="ngram", gamma=12)
    assert cli.main(["generate", "--target", str(tiny_engines["target"]), "--draft", "ngram",
                     "--gamma-max", "40", "--prompt", "ab"]) != 0


def test_stats_lists_grow_with_the_draft_length():
    s = Stats(gamma_max=2)
    assert s.histogram == [0, 0, 0] and s.tried_by_position == [0, 0]
    s.add_round(3, 5)
    assert len(s.histogram) == 6 and s.tried_by_position == [1, 1, 1, 1, 1] and s.accepted_by_position[:4] == [1, 1, 1, 0]
    assert s.rejections == 1 and s.drafted == 5 and s.accepted == 3


def test_costs_are_measured_within_the_smaller_engine_capacity(tiny_engines):
    """A draft of 48 rows beside a target of 128: every bucket fits the draft, and decoding past the draft's
    capacity still matches plain decoding."""
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["short"], gamma_max=16)
    assert gen.cost.contexts.tolist() == [48 - 16 - 2]
    plain = edgespec.load(tiny_engines["target"]).generate(PROMPT, max_new_tokens=60)
    assert gen.generate(PROMPT, max_new_tokens=60).token_ids == plain.token_ids


def test_lookup_draft_is_priced_as_its_draft_model(tiny_engines, monkeypatch):
    """Auto γ with lookup before the draft model: the load-time draft probes time the model (their contexts
    repeat, so lookup would find every continuation and price proposals as free)."""
    def never(*a, **k):
        raise AssertionError("the cost probe drafted by lookup")
    monkeypatch.setattr(LookupDraft, "_found", never)
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"], gamma=3, lookup=2)
    cm = gen.measure_costs(budget_s=0.0)
    assert cm.t_draft > 0


def test_rounds_drafted_by_lookup_do_not_teach_auto_the_draft_cost(tiny_engines, monkeypatch):
    """Auto γ refines its costs from real rounds; a round drafted by lookup ran no draft model, so its
    draft time (microseconds) is not blended into the model's per-proposal cost, while model rounds are."""
    seen = []  # (the round drafted by lookup, draft seconds passed to observe)
    real_draft, real_observe = LookupDraft.draft, CostModel.observe

    def draft(self, ctx, gamma, out):
        c = real_draft(self, ctx, gamma, out)
        seen.append([self.last_draft_unpriced, None])
        return c

    def observe(self, asked, proposed, draft_s, *a, **k):
        if asked:
            seen[-1][1] = draft_s
        return real_observe(self, asked, proposed, draft_s, *a, **k)
    monkeypatch.setattr(LookupDraft, "draft", draft)
    monkeypatch.setattr(CostModel, "observe", observe)
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"], lookup=1)
    gen.cost = CostModel([1e-3] * 9, t_draft=1e-4)  # cheap drafts: auto keeps drafting
    gen.generate([5, 6, 7, 8] * 4, max_new_tokens=40)
    by_lookup = [s for unpriced, s in seen if unpriced]
    by_model = [s for unpriced, s in seen if not unpriced and s is not None]
    assert by_lookup and by_model
    assert all(s == 0.0 for s in by_lookup) and all(s > 0 for s in by_model)
