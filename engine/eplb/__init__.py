"""Expert load balancing under expert parallelism: replicas of hot experts and their placement among the ranks,
decided from the measured load (``policy``), looked up per token (``placement``), moved between steps
(``transfer``) and run by each rank (``balancer``)."""
