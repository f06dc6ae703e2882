"""Training the bundled models (not shipped with the exporter: export/ never imports this package).

    python -m edgespec.export.training.train_demo --out models           # the text pair (resumable)
    python -m edgespec.export.training.train_text_head ...               # a text draft head, distilled
    python -m edgespec.export.training.train_vla --train ... --out models/vla-reacher   # the VLA pair
    python -m edgespec.export.training.train_draft_head --policy ...     # a VLA draft head, distilled
    python -m edgespec.export.training.train_feature_head --model ...    # a FAST policy's feature head, distilled
    python -m edgespec.export.training.train_openvla ...                 # an OpenVLA-format reacher policy
"""
