"""Expert load, measured and balanced: the MoE layers' routed-token counters read back without a host wait
(``expert_load``: statistics, and the load balancing decides from), and under expert parallelism replicas of hot
experts and their placement among the ranks, decided from the measured load (``policy``), looked up per token
(``placement``), moved between steps (``transfer``) and run by each rank (``balancer``)."""
