"""Training the bundled models (not shipped with the exporter: export/ never imports this package).

    python -m edgespec.export.training.train_demo --out models           # the text pair (resumable)
    python -m edgespec.export.training.train_text_head ...               # a text draft head, distilled
    python -m edgespec.export.training.train_vla --train ... --out models/vla-reacher   # the VLA pair
    python -m edgespec.export.training.train_draft_head --policy ...     # a VLA draft head, distilled
    python -m edgespec.export.training.train_feature_head --model ...    # a FAST policy's feature head, distilled
    python -m edgespec.export.training.train_openvla ...                 # an OpenVLA-format reacher policy
"""


def optimizer_step(loss, opt, sched, bar, scale: float = 1.0) -> float:
    """One training step on `loss` (a torch scalar): gradients zeroed, back-propagated, the optimizer and its
    schedule stepped, the progress bar moved with loss / scale shown. -> loss.item()"""
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    value = loss.item()
    bar.update(1)
    bar.set_postfix(loss=f"{value / scale:.3f}")
    return value
