"""Pipelined rounds for a remote target (one greedy sequence).

A remote verify spends most of its time on the network and the server, while the device waits. With
`RemoteConfig(pipeline=True)` the device uses that time: while round r's verify is out, it bets that every
draft of round r will be accepted, drafts on (the draft model's next token is its guess of round r's bonus
token, the γ after it are round r+1's drafts) and sends round r+1's verify at once. If round r keeps all
its drafts and its bonus equals the guess, round r+1's drafts are ready and its verify is already on its way:
a round trip saved (a hit). Otherwise the bet's reply is dropped and the draft model rewinds to what round
r kept. A miss costs the server one verify and the device the drafting it did while it waited; the output
is the same either way (every emitted token is the target's own greedy choice).

`PipelinedRounds` is one of the decode loop's strategies (loop.py): chosen for one greedy sequence when the
target declares `caps.pipeline` and the drafter runs a draft model. Hits and bets are counted in the target's
counters (prefetch_hits, prefetched).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .backends.base import Decoder
from .backends.remote_decoder import Pending
from .drafts import Drafter
from .profiling import Timer
from .sampling import check_ids
from .speculative import greedy_rule


@dataclass
class _Bet:
    ctx_len: int  # the context length of the round the bet is for (all drafts + the guessed bonus kept)
    pending: int  # the guessed bonus token: that round's pending token
    drafts: list[int]  # that round's drafts
    call: Pending  # its verify, already sent


class PipelinedRounds:
    def __init__(self):
        self.bet: _Bet | None = None

    def __call__(self, target: Decoder, drafter: Drafter | None, seqs: list, active, gamma: int, span: int,
                 timer: Timer | None = None) -> tuple[list[list[int]], list[int], list[int]]:
        """One round of seqs[0] (the loop's strategy signature): returns ([emitted ids], [kept drafts k],
        [drafted c]) and commits the kept rows in the target and the drafter. `span` is not used: lookup
        rounds are not pipelined."""
        new, k, c = self.round(target, drafter, seqs[0].ctx, gamma, timer=timer)
        return [new], [k], [c]

    def round(self, target: Decoder, drafter: Drafter | None, ctx: list[int], gamma: int, rule=greedy_rule,
              timer: Timer | None = None) -> tuple[list[int], int, int]:
        """One round, as fast_round: returns (emitted ids, kept drafts k, drafted c)."""
        t0 = time.perf_counter()
        eng = target.engine
        bet, self.bet = self.bet, None
        if bet is not None and (bet.ctx_len != len(ctx) or bet.pending != ctx[-1] or len(bet.drafts) > gamma):
            if drafter is not None:  # its rows run ahead of ctx: back to the committed ones
                drafter.rewind(len(ctx) - 1)
            bet = None
        if bet is not None:  # the bet won: this round's drafts are known and its verify is out
            drafts, call = bet.drafts, bet.call
            with eng.lock:
                eng.counters.prefetch_hits += 1
        else:
            buf = np.empty(gamma, np.int64)
            c = drafter.draft(ctx, gamma, buf) if gamma and drafter is not None else 0
            drafts = buf[:c].tolist()
            call = target.submit([ctx[-1]] + drafts)
        t1 = time.perf_counter()
        # while it is out: bet that every draft is kept, guess the bonus, draft on, send that verify
        nxt_bet = None
        room = min(target.max_context, drafter.decoder.max_context) if drafter is not None else 0
        if drafter is not None and drafts and len(drafts) == gamma and call.future is not None \
                and len(ctx) + 2 * gamma + 2 < room:
            spec = ctx + drafts
            e = np.empty(gamma + 1, np.int64)
            if drafter.model_draft(spec, gamma + 1, e) == gamma + 1:  # the model (lookup's cache is its)
                nxt_bet = _Bet(len(spec) + 1, int(e[0]), e[1:].tolist(),
                               target.submit(e.tolist(), ahead=[ctx[-1]] + drafts))
                with eng.lock:
                    eng.counters.prefetched += 1
        t2 = time.perf_counter()
        t = target.result(call)  # (c+1,): [i] predicts position len(ctx) + i
        t3 = time.perf_counter()
        check_ids(t, "target", len(ctx))
        k, nxt = rule(np.asarray(drafts, np.int64), t, len(ctx))
        target.cache.commit(1 + k)
        if nxt_bet is not None and k == len(drafts) and nxt == nxt_bet.pending:
            self.bet = nxt_bet  # the drafter's rows past ctx are next round's: keep them
        elif drafter is not None:
            drafter.rewind(len(ctx) + k)
        if timer is not None:
            timer.add("draft", t0, t1)
            timer.add("draft", t1, t2)  # drafted while the verify was out
            timer.add("verify", t2, t3)
            timer.add("sampling", t3, time.perf_counter())
        return drafts[:k] + [nxt], k, len(drafts)

    def close(self) -> None:
        """Drop a bet still out (the sequence ended): its reply is ignored."""
        self.bet = None
