"""Workflows: FedAvg, ScatterAndGather (server-controlled algorithms on the Controller API)."""
