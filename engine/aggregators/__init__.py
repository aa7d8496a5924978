"""Aggregators: fold weighted client results into one model (`WeightedAggregationHelper`, `DXOAggregator`)."""
