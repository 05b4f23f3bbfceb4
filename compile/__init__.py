"""kiln.compile"""
