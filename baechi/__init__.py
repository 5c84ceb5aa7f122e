"""Baechi's memory-constrained placement: grouping, fusion, the placers m-TOPO, m-ETF and m-SCT,
their LP, the schedule simulator, and applying a placement to a TF graph.

The algorithm modules read the cost-graph IR and never import TensorFlow; nothing here imports
``remat`` (the orchestration that combines both lives in ``graphfit.pipeline``).
"""
