"""ToyDiT, a model family as a plug-in: this package is registered through the ``sdtrain.families`` entry point
(``../sdtrain_toydit-0.1.dist-info/entry_points.txt``), so that with ``tests/plugins`` on ``sys.path`` the registry
finds it as it finds an installed package's family. Nothing in the repository's library names it.

Modules: ``model`` (the transformer, text encoder and tokenizer), ``objective`` (the reversed-target rectified flow and
its flags), ``options`` (the load flags and their reader), ``family`` (the ``ModelFamily``: files, prompts,
prediction, adapter names, sampling, tiny model).
"""

from .family import TOYDIT, ToyDiTFamily

FAMILIES = (TOYDIT,)
ORDER = 15  # between the FLUX folder (10) and the SD3 folder (20)

__all__ = ["TOYDIT", "ToyDiTFamily", "FAMILIES", "ORDER"]
