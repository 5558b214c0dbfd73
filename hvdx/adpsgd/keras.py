"""AD-PSGD's names as this module held them: `ADPSGD` (`hvdx.adpsgd.method`) and
`ADPSGDCallback`, hvdx's one method driver building an ADPSGD per `fit`
(`hvdx.callbacks.method`); kept for the code that imports them from here.

    model.fit(..., callbacks=[hvdx.adpsgd.ADPSGDCallback(topology="ring", max_seconds=600)])
"""
from hvdx.adpsgd.method import ADPSGD, check_cross_node_weight, check_optimizer
from hvdx.callbacks.method import ADPSGDCallback

__all__ = ["ADPSGD", "ADPSGDCallback", "check_cross_node_weight", "check_optimizer"]
