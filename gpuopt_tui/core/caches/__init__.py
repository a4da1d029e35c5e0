"""The on-disk caches kept between runs, listed and cleared without torch: `features` (ablation's per-layer
features), `gradients` (TracIn's projected training gradients) and `files` (content digests and change stamps
they share)."""
