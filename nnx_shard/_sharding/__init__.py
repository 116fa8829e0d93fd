"""From a strategy to a plan: tactics, their parser, logical and explicit axes, inference; nothing allocated."""
