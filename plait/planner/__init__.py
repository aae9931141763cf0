"""The planner: what the seeds compute by hand, for any model, layout and cluster.

    from plait.planner import ModelDims, Layout, cluster, predict, search
    p = predict(ModelDims.from_config(cfg.model, seq=8192), Layout(tp=8, pp=4, dp_shard=2, zero=1),
                cluster("h100", nodes=8), global_batch=1024)
    p.memory_bytes, p.traffic, p.step_time_s, p.mfu, p.bubble

Modules: hardware (GPU/link catalog, cluster), costs (parameters, FLOPs), memory (model state,
activations), traffic (collective volumes and alpha-beta times), roofline, layout, stage_costs,
predict, simulate (pipeline timing from plait.parallel.schedules), search, placement (ranks ->
GPUs), fleet (many jobs on a fleet), report (text and JSON). docs/planner.md has the formulas.
"""

from plait.planner.costs import ModelDims
from plait.planner.hardware import Cluster, cluster
from plait.planner.layout import Layout
from plait.planner.memory import PRECISIONS, Precision
from plait.planner.predict import Prediction, predict
from plait.planner.search import Space, search

__all__ = ["ModelDims", "Cluster", "cluster", "Layout", "Precision", "PRECISIONS", "Prediction", "predict",
           "Space", "search"]
