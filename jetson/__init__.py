"""oval_edge.jetson"""
