"""The built-in models: the zoo of workloads, torchvision-free ResNet and ViTs, the muP models."""
