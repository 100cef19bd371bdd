"""musubi-tuner's qwen_image_cache_latents.py, named so that its documented workflow (cache, then train) runs
refuses with a message that says what to do instead (exit status 2): musubi-tuner's separate caching step is not
done yet. qwen_image_train_network.py / qwen_image_train.py encode the latents and Qwen2.5-VL's outputs inside the
run (before training, the encoders then freed), so the step can be skipped; musubi-tuner's cache files are neither
written nor read here.

For a cache on disk that later runs reuse, add ``--cache_latents_to_disk`` /
``--cache_text_encoder_outputs_to_disk`` (and ``--cache_dir``) to the training command line, or run
tools/cache_latents.py / tools/cache_text_encoder_outputs.py with the training command line.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Refuse with what to do instead; exit status 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    print(
        "error: qwen_image_cache_latents.py is not supported yet (musubi-tuner's separate caching step); skip it: "
        "qwen_image_train_network.py caches the latents and Qwen2.5-VL outputs inside the run (add --cache_latents_to_disk / "
        "--cache_text_encoder_outputs_to_disk to keep them on disk)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
