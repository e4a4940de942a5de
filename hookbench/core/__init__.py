"""What every layer above stands on: the Workload (a training step as data), spawning ranks, the hook-leak guard, the optional-prerequisite rule."""
