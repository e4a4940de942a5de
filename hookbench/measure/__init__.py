"""Measurement: parity with the standard step, memory (fake, eager and CUDA backends), the hook and saved-tensor contracts, the muP coordinate check, the faults, ZeRO-2's spawned runs, the peers."""
