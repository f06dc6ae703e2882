"""A vLLM general plugin (entry point `vllm.general_plugins`): verify calls that read vLLM's prefix cache.

edgespec verifies drafts on a vLLM server with one completion call per round: prompt = context + drafts,
`prompt_logprobs` gives the target's top token at every draft position (remote.py). vLLM skips its prefix
cache for every request that asks for prompt logprobs, because a cached position has no logits to return:
each verify would recompute the whole context. This plugin, loaded by vLLM in each of its processes,
changes two things, and only for requests that opt in with `vllm_xargs: {"edgespec_verify": 1}`:

- the request reads the prefix cache (`SamplingParams.skip_reading_prefix_cache = False`), so a verify
  computes the positions after the longest cached block prefix, not the whole context;
- the prompt-logprob rows of the positions the cache skipped are a sentinel, not uninitialised memory (for
  every request: vLLM fills each row it computes, so this changes nothing else): token 0 with logprob
  SKIPPED_LOGPROB = +1.0, which no computed row can hold (a log-probability is <= 0). The client never
  reads a skipped row as a result (remote.py checks every row it reads);
- the server turns the leading skipped rows into None (as vLLM does for position 0) instead of detokenizing
  them and building a dict per row: a verify's reply costs its computed rows, not its whole context.

The client also sends a cache salt per generation, so the only cached blocks a verify can hit are its own
generation's earlier calls, which end before the current call's first draft position.

Nothing in edgespec's runtime imports this module; vLLM does, in the server's environment, when edgespec is
installed there (`pip install 'edgespec[fleet]'`; `EDGESPEC_VLLM_PLUGIN=0` turns it off).
"""
from __future__ import annotations

import os

FLAG = "edgespec_verify"  # the vllm_xargs key a verify call sets
SKIPPED_LOGPROB = 1.0  # the logprob of a prompt-logprob row the prefix cache skipped (never computed)


def _opted_in(params) -> bool:
    extra = getattr(params, "extra_args", None) or {}
    return bool(extra.get(FLAG))


def register() -> None:
    if os.environ.get("EDGESPEC_VLLM_PLUGIN", "1") == "0":
        return
    try:
        from vllm.entrypoints.openai.completion import protocol
        from vllm.v1.outputs import LogprobsTensors
    except ImportError as e:  # no vLLM here, or another layout: say so in the server log, change nothing
        print(f"edgespec vLLM plugin: not applied ({e}); verify calls will recompute the whole context")
        return
    if getattr(LogprobsTensors, "_edgespec_patched", False):
        return
    empty_cpu = LogprobsTensors.empty_cpu

    def zeroed_cpu(num_positions: int, num_tokens_per_position: int):
        t = empty_cpu(num_positions, num_tokens_per_position)
        t.logprob_token_ids.zero_()
        t.selected_token_ranks.zero_()
        t.logprobs.fill_(SKIPPED_LOGPROB)
        return t

    LogprobsTensors.empty_cpu = staticmethod(zeroed_cpu)
    LogprobsTensors._edgespec_patched = True

    to_sampling_params = protocol.CompletionRequest.to_sampling_params

    def verify_reads_cache(self, *args, **kwargs):
        params = to_sampling_params(self, *args, **kwargs)
        if _opted_in(params) and params.prompt_logprobs is not None:
            params.skip_reading_prefix_cache = False
        return params

    protocol.CompletionRequest.to_sampling_params = verify_reads_cache

    try:
        from vllm.v1.engine.logprobs import LogprobsProcessor
    except ImportError:
        return
    update = LogprobsProcessor._update_prompt_logprobs

    def skipped_rows_are_none(self, tensors):
        """Leading rows the prefix cache skipped become None (as position 0 is), with no detokenizing and
        no per-row dicts: a verify's reply then costs its computed rows, not its whole context."""
        if not isinstance(self.prompt_logprobs, list):
            return update(self, tensors)
        # a skipped row: the sentinel logprob and rank 0 (a computed row's selected token has rank >= 1)
        computed = (tensors.logprobs[:, 0] != SKIPPED_LOGPROB) | (tensors.selected_token_ranks != 0)
        first = int(computed.int().argmax()) if bool(computed.any()) else len(computed)
        if first == 0:
            return update(self, tensors)
        self.prompt_logprobs.extend([None] * first)
        if first < len(computed):
            update(self, tensors._replace(logprob_token_ids=tensors.logprob_token_ids[first:],
                                          logprobs=tensors.logprobs[first:],
                                          selected_token_ranks=tensors.selected_token_ranks[first:]))

    LogprobsProcessor._update_prompt_logprobs = skipped_rows_are_none
