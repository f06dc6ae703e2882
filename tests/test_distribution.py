"""Speculative sampling reproduces the target's distribution: rejection sampling (Leviathan et al. 2023,
Theorem 1) and coupled sampling (Gumbel-max with noise keyed by position, shared by draft and target).

Unit level: accept/reject one draft token drawn from q gives tokens distributed as p; one coupled draw
argmax(filtered logits + Gumbel noise) is distributed as p.
End to end: four-token continuations sampled with speculation (both acceptance modes) match the exact
joint distribution of the target (computed by enumerating every continuation inside top-k), by chi-square,
with temperature, top-k and top-p; each test also checks that a 2% shift of probability mass would have
been detected.
"""

import numpy as np
import pytest
from scipy import stats as st

import edgespec
from edgespec.backends.ort import OrtDecoder
from edgespec.sampling import GumbelNoise, SamplingConfig, probs
from edgespec.speculative import accept_rejection

ALPHA = 1e-3  # significance level: fixed seeds make each test deterministic


def chi2_pvalue(counts: np.ndarray, expected_p: np.ndarray) -> float:
    n = counts.sum()
    exp = expected_p * n
    big = exp >= 5  # pool sparse cells so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    keep = exp > 0
    return float(st.chisquare(obs[keep], exp[keep]).pvalue)


def shifted(p: np.ndarray, amount: float = 0.02) -> np.ndarray:
    """Move `amount` of mass from the most likely cell to the second most likely one."""
    q = p.copy()
    a, b = np.argsort(-p)[:2]
    q[a] -= amount
    q[b] += amount
    return q


@pytest.mark.parametrize("point_mass", [False, True])
def test_accept_reject_step_reproduces_p(point_mass):
    rng = np.random.default_rng(0)
    v, n = 12, 40000
    p = rng.dirichlet(np.ones(v) * 0.7)
    q = rng.dirichlet(np.ones(v) * 0.7)
    p2 = np.stack([p, p])  # row 1 (bonus) unused when the draft is rejected
    counts = np.zeros(v)
    for _ in range(n):
        if point_mass:  # an n-gram style draft: always proposes token 3 with certainty
            d, qrow = 3, None
        else:
            d = int(rng.choice(v, p=q))
            qrow = q[None]
        k, nxt = accept_rejection(np.array([d]), p2, qrow, rng)
        counts[d if k == 1 else nxt] += 1
    assert chi2_pvalue(counts, p) > ALPHA
    assert chi2_pvalue(counts, shifted(p)) < ALPHA


@pytest.mark.parametrize("kw,want", [
    # logits [2, 1, 0, -1] / T 0.5 = [4, 2, 0, -2] -> softmax
    (dict(temperature=0.5), np.exp([4.0, 2, 0, -2]) / np.exp([4.0, 2, 0, -2]).sum()),
    # top-k 3 drops only -2 (the third largest, 0, is kept)
    (dict(temperature=0.5, top_k=3), np.array([np.exp(4), np.exp(2), 1, 0]) / (np.exp(4) + np.exp(2) + 1)),
    # softmax over [4, 2, 0] = [0.8668, 0.1173, 0.0159]: top-p 0.9 keeps the first two
    # (mass before the second is 0.8668 < 0.9, before the third 0.9841 >= 0.9)
    (dict(temperature=0.5, top_k=3, top_p=0.9), np.array([np.exp(4), np.exp(2), 0, 0]) / (np.exp(4) + np.exp(2))),
    # top-p 0.8: the most likely token alone already reaches 0.8
    (dict(temperature=0.5, top_p=0.8), np.array([1.0, 0, 0, 0])),
])
def test_probs_applies_temperature_top_k_top_p(kw, want):
    """The distribution tests compare speculation with `probs` itself, so `probs` is checked by hand here."""
    got = probs(np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32), SamplingConfig(**kw))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)


def test_coupled_draw_reproduces_p():
    """Coupled mode draws token `pos` of row `b` as argmax(filtered logits + noise(b, pos)): over many
    (b, pos) keys that must be a sample from probs(logits) (Gumbel-max), top-k / top-p cells included."""
    rng = np.random.default_rng(1)
    v, rows, positions = 12, 200, 100  # 20,000 draws, each from its own (b, pos) noise
    logits = rng.normal(0, 1.5, v).astype(np.float32)
    cfg = SamplingConfig(temperature=0.8, top_k=10, top_p=0.97)
    p = probs(logits, cfg)
    assert (p == 0).sum() >= 2  # the filters cut some cells, which must then never be drawn
    noise = GumbelNoise(seed=7, vocab_size=v)
    draws = [noise.pick(logits, cfg, b, pos) for b in range(rows) for pos in range(positions)]
    counts = np.bincount(draws, minlength=v).astype(float)
    assert counts[p == 0].sum() == 0
    assert chi2_pvalue(counts, p) > ALPHA
    assert chi2_pvalue(counts, shifted(p)) < ALPHA


def exact_joint(engine, prompt, cfg, depth=4):
    """{continuation tuple: probability} for `depth` sampled tokens (or up to EOS), by enumeration."""
    out = {}
    eos = set(engine.manifest.eos_token_ids)

    def walk(prefix, prob):
        if len(prefix) == depth or (prefix and prefix[-1] in eos):
            out[tuple(prefix)] = prob
            return
        d = OrtDecoder(engine, 1)
        p = probs(d(np.array([prompt + prefix]))[0, -1], cfg)
        for t in np.nonzero(p > 1e-12)[0]:
            walk(prefix + [int(t)], prob * p[t])
    walk([], 1.0)
    return out


CASES = {
    "T1-topk4": dict(temperature=1.0, top_k=4),
    "T0.7-topk5-topp0.9": dict(temperature=0.7, top_k=5, top_p=0.9),
    "T1.3-topp0.6": dict(temperature=1.3, top_k=6, top_p=0.6),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("draft,acceptance", [("noisy", "rejection"), ("ngram", "rejection"), ("noisy", "coupled"),
                                            ("lookup", "rejection")])
def test_speculative_sampling_matches_the_target_joint(tiny_engines, case, draft, acceptance):
    """lookup: the noisy draft model behind prompt lookup (the repetitive prompt gives lookup hits, so a
    batch mixes lookup drafts, deterministic, with the model's sampled ones)."""
    kw = CASES[case]
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    draft_kw = {"ngram": dict(draft="ngram"), "lookup": dict(draft=tiny_engines["noisy"], lookup=1)}.get(
        draft, dict(draft=tiny_engines.get(draft)))
    gen = edgespec.load(tiny_engines["target"], gamma=3, **draft_kw)
    joint = exact_joint(gen.target, prompt, SamplingConfig(**kw))
    cells = sorted(joint)
    p = np.array([joint[c] for c in cells])
    assert abs(p.sum() - 1) < 1e-9
    index = {c: i for i, c in enumerate(cells)}
    counts = np.zeros(len(cells))
    batch, n_batches = 250, 40  # 10,000 samples, decoded 250 at a time (batched speculation)
    outs = [gen.generate([prompt] * batch, max_new_tokens=4, seed=seed, acceptance=acceptance, **kw)
            for seed in range(n_batches)]
    for out in (o for batch_out in outs for o in batch_out):
        counts[index[tuple(out.token_ids)]] += 1
    st_ = outs[-1][0].stats
    assert st_.drafted > 0 and 0 < st_.accepted < st_.drafted  # speculation happened, with both outcomes
    assert chi2_pvalue(counts, p) > ALPHA, "four-token joint differs from the target's"
    for pos in range(4):  # single-token marginals
        at = lambda c: c[pos] if pos < len(c) else -1  # noqa: E731  (-1: ended at EOS before pos)
        marg_cells = sorted({at(c) for c in cells})
        mp = np.array([sum(joint[c] for c in cells if at(c) == t) for t in marg_cells])
        mc = np.array([sum(counts[index[c]] for c in cells if at(c) == t) for t in marg_cells])
        assert chi2_pvalue(mc, mp) > ALPHA, f"marginal of token {pos + 1} differs"
        if pos == 1 and len(mp) > 1:  # the first speculated token: a 2% shift must not go unseen
            assert chi2_pvalue(mc, shifted(mp)) < ALPHA, "test too weak to see a 2% shift"
