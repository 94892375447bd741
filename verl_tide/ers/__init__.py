"""ERS: Elastic Resource Scaling between rollout and Ref at the weight-sync boundary (paper Sec. 5.2)."""
