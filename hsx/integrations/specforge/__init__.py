"""SpecForge: its offline export format (export) and the feed of a running job into its training loop
(feeder, with its layout, schedule, argument set and Mooncake store)."""
