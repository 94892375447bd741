"""RA2P: Resource-Aware Ref-Actor Pipelining (paper Sec. 5.1, Appendix A)."""
