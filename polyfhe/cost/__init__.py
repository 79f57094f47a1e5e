"""The cost model: workloads of compiled programs, op-cost probes, predictions per engine and machine."""
