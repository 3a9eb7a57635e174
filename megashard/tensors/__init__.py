"""Sharding utilities: TP attributes, DTensor placements, local shapes/offsets, flat sharded tensors."""
