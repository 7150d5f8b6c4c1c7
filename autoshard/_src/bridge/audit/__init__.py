"""What XLA compiled and what the devices measure: audit against the plan, the HLO reader, op and collective timing."""
