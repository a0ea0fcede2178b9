"""``gqakit replicate``: the GQA paper's experiments, re-run end to end on a multi-head model trained here.

::

    [1/7] corpus      wiki-en train / validation / test (the asset, or the text given)
    [2/7] tokenizer   a byte-level BPE trained on the train split
    [3/7] pretrain    a Llama-architecture MHA model from random initialisation (LM objective)
    [4/7] convert     MHA -> MQA by every method, and -> GQA at every G (mean pooling)
    [5/7] uptrain     every arm for its proportion alpha of the pretraining tokens; MQA and GQA from scratch
    [6/7] measure     test perplexity of every model; decode time and KV bytes per token at every G
    [7/7] report      report.md, results.json, figures like the paper's

Every checkpoint and measurement is cached in ``--work-dir`` (:class:`~gqakit.pipelines.store.ResultStore`),
keyed by exactly what it depends on, so a second run takes seconds and a changed setting reruns only
what depends on it. Pretraining and uptraining are gqakit's own loop (:func:`gqakit.uptrain.train.uptrain`)
with the LM objective, every run from the same data order for a given seed.

The package's parts: ``options`` (the model, the arms, the options), ``train`` (each cached training and
measuring step), ``run`` (the pipeline and its click command) and ``report``.
"""

from gqakit.pipelines.replicate.options import ModelShape, ReplicateOptions
from gqakit.pipelines.replicate.run import ReplicateResult, pretrain_mha, replicate_cmd, run_replicate

__all__ = [
    "ModelShape",
    "ReplicateOptions",
    "ReplicateResult",
    "pretrain_mha",
    "replicate_cmd",
    "run_replicate",
]
