"""slothkit"""
