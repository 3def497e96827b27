"""oval_edge.runtime"""
