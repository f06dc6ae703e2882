"""Run statistics: one `RoundStats` per decode, text (`GenerationResult.stats`) and policy chunks
(`Policy.last_info` is its `policy_info()`)."""
from __future__ import annotations

from dataclasses import dataclass, field

@dataclass
class RoundStats:
    """Statistics of one decode, text or policy: rounds, drafts kept per position, calls and times."""
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # rounds that stopped at a rejected draft (α̂ = accepted / (accepted + rejections))
    gamma_max: int = 0  # presizes the lists below (they grow if a longer draft is ever seen)
    accepted_by_position: list = field(default_factory=list)  # drafts kept at position i
    tried_by_position: list = field(default_factory=list)  # drafts proposed at position i
    histogram: list = field(default_factory=list)  # rounds that kept k drafts
    gamma_history: list = field(default_factory=list)  # (new tokens so far, γ chosen)
    time_s: dict = field(default_factory=dict)  # prefill, draft, verify, sampling, other, decode, total
    target_calls: int = 0
    draft_calls: int = 0
    engine_s: float = 0.0  # time inside engine runs (target + draft) while decoding
    fallbacks: int = 0  # remote target: verify calls that ran on the local target instead (remote.py)
    plain_rounds: int = 0  # rounds of γ = 0 (plain steps)

    def __post_init__(self):
        self._grow(self.gamma_max)

    def _grow(self, gamma: int) -> None:
        for lst, n in ((self.accepted_by_position, gamma), (self.tried_by_position, gamma),
                       (self.histogram, gamma + 1)):
            lst.extend([0] * (n - len(lst)))

    def add_round(self, kept: int, drafted: int) -> None:
        """One sequence's round: `drafted` proposals, the first `kept` of them accepted."""
        if drafted >= len(self.histogram):
            self._grow(drafted)
        self.drafted += drafted
        self.accepted += kept
        self.histogram[kept] += 1
        self.rejections += int(kept < drafted)
        for j in range(drafted):
            self.tried_by_position[j] += 1
            self.accepted_by_position[j] += int(j < kept)

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of decoding (after the prompt's prefill)."""
        d = self.time_s.get("decode", 0.0)
        return self.new_tokens / d if d else 0.0

    @property
    def host_fraction(self) -> float:
        """Share of decode wall time spent outside engine runs (Python, numpy, binding)."""
        return 1.0 - self.engine_s / self.time_s["decode"] if self.time_s.get("decode") else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Emitted tokens per target call (the prefill counts: it emits the first token); plain = 1."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def speculative_rounds(self) -> int:
        """Rounds that asked the draft for at least one token (the rest were plain steps)."""
        return self.rounds - self.plain_rounds

    def policy_info(self) -> dict:
        """A policy chunk's statistics as Policy.last_info reports them: rounds and drafts of the speculative
        rounds, every target call, the draft's calls, emitted tokens per target call."""
        return {"rounds": self.speculative_rounds, "drafted": self.drafted, "accepted": self.accepted,
                "target_calls": self.target_calls, "draft_calls": self.draft_calls,
                "tokens_per_round": self.new_tokens / self.target_calls if self.target_calls else 0.0}

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(acceptance_rate=self.acceptance_rate,
                 mean_accepted_per_round=self.accepted / self.rounds if self.rounds else 0.0,
                 tokens_per_round=self.tokens_per_round, tokens_per_second=self.tokens_per_second,
                 host_fraction=self.host_fraction,
                 acceptance_by_position=[a / t if t else None for a, t in
                                         zip(self.accepted_by_position, self.tried_by_position)])
        return d
