"""The core model and the pure stages on it: types, conversion, endpoint selection,
balancing, explain."""
