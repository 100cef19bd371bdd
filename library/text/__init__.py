"""Captions and prompts before the text encoder: ``prompt_weighting`` (A1111 ``(word:1.2)`` weights),
``textual_inversion`` (embedding files and the tokens they add), ``token_captions`` (captions that spell out a
multi-vector token)."""
