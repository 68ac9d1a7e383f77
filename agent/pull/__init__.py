"""Moving a snapshot onto the node: resolver, flights, tuning, staging, the puller."""
