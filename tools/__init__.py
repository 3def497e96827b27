"""oval_edge.tools"""
