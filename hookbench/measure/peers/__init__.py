"""Other libraries that implement what hookbench implements, built the way each library says
to, for side-by-side comparisons. Each module needs its own optional extra."""
