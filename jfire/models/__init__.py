"""Model families: the seam every family implements (family.py), the registry that picks one
for a checkpoint (registry.py), and the families. Importing the package loads none of them."""
